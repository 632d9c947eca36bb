"""`asyncrl serve` as a user runs it (a subprocess, stopped with Ctrl-C), then `asyncrl trajectories`
on what it recorded."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from gateway_helpers import TOOLS, serve_banner

from asyncrl.cli import main
from asyncrl.gateway.inspect import show_trajectory
from asyncrl.gateway.store import open_store

TINY = [
    "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1", "policy.tiny.num_heads=2", "policy.tiny.intermediate_size=32",
    "policy.tiny.moe_intermediate_size=16", "policy.tiny.kv_lora_rank=16", "policy.tiny.q_lora_rank=16",
    "policy.tiny.qk_rope_head_dim=8", "policy.tiny.qk_nope_head_dim=8", "policy.tiny.v_head_dim=8",
    "policy.tiny.index_head_dim=16", "rollout.num_workers=2", "rollout.torch_threads=1", "rollout.max_num_seqs=4",
    "rollout.sampling.max_tokens=8",
]  # fmt: skip


@pytest.mark.slow
def test_serve_records_what_an_agent_does_and_trajectories_shows_it(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    command = [sys.executable, "-m", "asyncrl.cli", "serve", "quickstart", f"runs_dir={tmp_path}", "name=demo", *TINY]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, banner = serve_banner(process)
        assert f"authorization: Bearer $(asyncrl token {tmp_path / 'demo'})" in banner
        assert main(["token", str(tmp_path / "demo")]) == 0
        run_token = capsys.readouterr().out.strip()
        assert run_token.startswith("rt-") and run_token not in banner  # the banner says how to get it, never what it is
        assert httpx.post(url + "/rollouts", json={"task": "demo"}).status_code == 401
        as_run = {"authorization": f"Bearer {run_token}"}
        opened = httpx.post(url + "/rollouts", json={"task": "demo", "group_id": "g"}, headers=as_run).json()
        agent = openai.OpenAI(base_url=url + "/v1", api_key=opened["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = agent.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "more"})
        agent.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        health = httpx.get(url + "/health").json()
        assert len(health["engines"]) == 2 and health["rollouts_running"] == 1
        httpx.post(f"{url}/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0}, headers=as_run).raise_for_status()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    assert (tmp_path / "demo" / "gateway.secret").stat().st_mode & 0o077 == 0

    capsys.readouterr()
    assert main(["trajectories", "list", str(tmp_path / "demo")]) == 0
    listing = capsys.readouterr().out
    assert opened["rollout_id"] in listing and "ok" in listing
    assert main(["trajectories", "show", str(tmp_path / "demo"), opened["rollout_id"]]) == 0
    shown = capsys.readouterr().out
    assert "turn 1: branch 0" in shown and "log-prob" in shown and "<|user|>" in shown


def test_show_marks_sampled_tokens(tmp_path) -> None:
    from rich.console import Console

    from asyncrl.records import Turn

    store = open_store(tmp_path)
    rollout_id = store.open("t")
    store.append(Turn(rollout_id, [4, 40], [41, 1], [-0.25, -0.5], [3, 3]))
    store.append(Turn(rollout_id, [4, 40, 41, 1, 5, 42], [43], [-1.0], [4]))
    console = Console(record=True, width=120)
    show_trajectory(store, rollout_id, console)  # running: masks shown as they would be
    rows = [[cell.strip() for cell in line.split("│")] for line in console.export_text().splitlines() if re.match(r"\s*\d+ │", line)]
    sampled = [(r[0], r[3], r[4], r[5]) for r in rows if r[-1] == "1"]
    assert sampled == [("2", "-0.2500", "3", "1"), ("3", "-0.5000", "3", "1"), ("6", "-1.0000", "4", "1")]
    assert [r[0] for r in rows if r[-1] == "0"] == ["0", "1", "4", "5"]


def test_show_adds_the_kv_version_of_each_sampled_token_where_the_engine_recorded_them(tmp_path) -> None:
    from rich.console import Console

    from asyncrl.records import Turn

    store = open_store(tmp_path)
    rollout_id = store.open("t")
    store.append(Turn(rollout_id, [4, 40], [41, 1], [-0.25, -0.5], [3, 3], kv_versions=[2, 3]))
    store.append(Turn(rollout_id, [4, 40, 41, 1, 5, 42], [43], [-1.0], [4]))  # recorded none: its version stands in
    console = Console(record=True, width=120)
    show_trajectory(store, rollout_id, console)
    text = console.export_text()
    assert "kv version" in text
    rows = [[cell.strip() for cell in line.split("│")] for line in text.splitlines() if re.match(r"\s*\d+ │", line)]
    assert [(r[0], r[4], r[5]) for r in rows if r[-1] == "1"] == [("2", "3", "2"), ("3", "3", "3"), ("6", "4", "4")]


def test_show_decodes_a_runs_tokens_with_the_tokenizer_of_the_policy_its_config_names(tmp_path, capsys) -> None:
    """A run of a pretrained policy is shown in that policy's tokens, not the tiny policy's."""
    from gguf_model import tiny_smollm2

    from asyncrl.records import Turn

    model, tokenizer = tiny_smollm2()
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"policy:\n  path: {tmp_path / 'policy'}\n  mtp: {{enabled: false}}\n")
    store = open_store(run)
    rollout_id = store.open("t")
    prompt, reply = tokenizer.encode("what is"), tokenizer.encode(" sunny")
    store.append(Turn(rollout_id, prompt, reply, [-0.5] * len(reply), [0] * len(reply)))
    store.close()
    assert main(["trajectories", "show", str(run), rollout_id]) == 0
    shown = capsys.readouterr().out
    assert all(repr(tokenizer.decode([token]))[1:-1] in shown for token in reply)


@pytest.mark.slow
def test_two_serve_replicas_over_one_store_serve_each_others_rollouts(tmp_path, capsys) -> None:
    """`asyncrl serve` twice with one config but its own gateway.replica_id (and port): a rollout opened at
    one is served there when its agent calls the other; a third process taking a live replica's id is refused."""
    import os
    import uuid

    redis_url = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")
    common = [
        sys.executable, "-m", "asyncrl.cli", "serve", "quickstart", f"runs_dir={tmp_path}", "name=pair", *TINY,
        "rollout.num_workers=1", "store.type=redis", f"store.url={redis_url}", f"store.namespace=serve-{uuid.uuid4().hex}",
    ]  # fmt: skip
    first = subprocess.Popen([*common, "gateway.replica_id=a"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = None
    try:
        url_a, banner_a = serve_banner(first)
        assert "replica a of a;" in banner_a
        second = subprocess.Popen([*common, "gateway.replica_id=b"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url_b, banner_b = serve_banner(second)
        assert "replica b of a, b;" in banner_b
        assert main(["token", str(tmp_path / "pair")]) == 0
        as_run = {"authorization": f"Bearer {capsys.readouterr().out.strip()}"}  # one secret: valid at both
        opened = httpx.post(url_a + "/rollouts", json={"task": "demo"}, headers=as_run).json()
        assert opened["rollout_id"].endswith("~a") and opened["base_url"] == url_a + "/v1"
        agent = openai.OpenAI(base_url=url_b + "/v1", api_key=opened["api_key"], max_retries=0)
        agent.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
        assert httpx.get(url_b + "/health").json()["forwarded"] == 1
        assert httpx.get(url_a + "/health").json()["rollouts_running"] == 1  # its home holds it
        finished = httpx.post(f"{url_b}/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0}, headers=as_run)
        assert finished.status_code == 200 and finished.json()["turns"] == 1
        twin = subprocess.run([*common, "gateway.replica_id=a"], capture_output=True, text=True, timeout=300)
        assert twin.returncode != 0 and "'a' is already announced" in twin.stdout + twin.stderr
    finally:
        for process in (first, second):
            if process is not None:
                process.send_signal(signal.SIGINT)
                process.wait(30)
