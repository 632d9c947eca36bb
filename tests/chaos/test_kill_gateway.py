"""Kill -9 `asyncrl serve` (the gateway on its own, with its engines and its SQLite store) in the middle of
episodes driven over HTTP, restart it with the same config, and check the books; and stop it with
SIGTERM while requests hang in flight or big prompts are being tokenized: it exits within a few seconds.

The rollout keys and the run token are HMACs under the secret in the run directory, so a gateway
restarted on that directory honours what the killed one issued; a rollout's conversation lived in the
killed process's memory, so its next turn starts a fresh branch in the store (a fork, which is safe).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import openai
import pytest
from services_helpers import PATIENCE_S, free_port, kill9, record_figures, wait_for

from asyncrl.gateway.app import GRACEFUL_SHUTDOWN_S
from asyncrl.gateway.client import GatewayClient, GatewayRefused
from asyncrl.gateway.store import open_store

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TINY_SERVE = [
    "policy.tiny.arch=qwen3", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=64", "policy.mtp.enabled=false", "rollout.max_num_seqs=8", "logging.wandb=disabled",
]  # fmt: skip


class Served:
    """`asyncrl serve quickstart` as a subprocess on a fixed port; ready once it prints its banner."""

    def __init__(self, tmp_path, name: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.args = ["quickstart", *TINY_SERVE, f"runs_dir={tmp_path}", f"name={name}", f"gateway.port={self.port}"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = tmp_path / name
        self.process: subprocess.Popen | None = None

    def start(self) -> Served:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "asyncrl", "serve", *self.args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output: list[str] = []
        listening = threading.Event()

        def read(stream) -> None:
            for line in stream:
                self.output.append(line)
                if "listening on" in line:
                    listening.set()
            listening.set()  # it exited

        threading.Thread(target=read, args=(self.process.stdout,), daemon=True).start()
        listening.wait(PATIENCE_S)
        assert self.process.poll() is None and listening.is_set(), "asyncrl serve did not start:\n" + "".join(self.output)
        return self

    def token(self) -> str:
        """The run token, as a person gets it: `asyncrl token CONFIG` with the overrides it was served with."""
        printed = subprocess.run([sys.executable, "-m", "asyncrl", "token", *self.args], capture_output=True, text=True, check=True)
        return printed.stdout.strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill9(self.process)


@pytest.fixture
def served(tmp_path):
    started: list[Served] = []

    def start(name: str, port: int | None = None) -> Served:
        server = Served(tmp_path, name, port).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def ask(base_url: str, api_key: str, content: str) -> openai.types.chat.ChatCompletion:
    agent = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60.0)
    try:
        return agent.chat.completions.create(model="policy", messages=[{"role": "user", "content": content}], max_tokens=6)
    finally:
        agent.close()


def test_rollouts_survive_a_kill_9_of_the_gateway_and_end_in_one_account_each(served):
    first = served("gw")
    token = first.token()
    with GatewayClient(first.url, token=token) as gateway:
        mid = gateway.open_rollout(task="mid-episode")  # one turn before the kill, one after
        fresh = gateway.open_rollout(task="no-turn-yet")  # opened before the kill, first turn after it
        lost = gateway.open_rollout(task="agent-gave-up")  # its agent went with the kill: aborted after the restart
        ask(mid.base_url, mid.api_key, "12+345")
    # The moment: a response arrived, the episode is between two turns.
    killed = time.monotonic()
    kill9(first.process)

    second = served("gw", port=first.port)
    restarted = time.monotonic()
    answer = ask(mid.base_url, mid.api_key, "12+345 again")  # a key the killed gateway issued
    answered = time.monotonic()
    assert answer.choices[0].message is not None
    ask(fresh.base_url, fresh.api_key, "7+8")
    with GatewayClient(second.url, token=token) as gateway:
        after = gateway.open_rollout(task="after-restart")
        ask(after.base_url, after.api_key, "1+2")
        for rollout in (mid, fresh, after):
            gateway.finish(rollout.rollout_id, reward=1.0)
        gateway.abort(lost.rollout_id, reason="its agent died with the gateway")
        # The run token the killed gateway's secret gave works on the new one (the calls above), and
        with pytest.raises(GatewayRefused) as twice:  # one account each: a second ending is refused
            gateway.finish(mid.rollout_id, reward=0.0)
        assert twice.value.status == 409
    kill9(second.process)

    store = open_store(second.run_dir / "trajectories.db")
    trajectories = {t.task: t for t in store.list()}
    counts = store.counts()
    store.close()
    assert {task: t.status for task, t in trajectories.items()} == {
        "mid-episode": "ok", "no-turn-yet": "ok", "agent-gave-up": "aborted", "after-restart": "ok",
    }  # fmt: skip
    assert [len(trajectories[task].turns) for task in ("mid-episode", "no-turn-yet", "agent-gave-up", "after-restart")] == [2, 1, 0, 1]
    assert counts["running"] == 0 and counts["ok"] == 3 and counts["aborted"] == 1
    record_figures(
        "kill_gateway",
        {"restart_to_listening_s": round(restarted - killed, 2), "kill_to_first_answer_on_an_old_key_s": round(answered - killed, 2),
         "rollouts": 4, "lost": 0, "ended_twice": 0},
    )  # fmt: skip


EXIT_MARGIN_S = 20.0
"""What an exit may take past the graceful period: closing the store and engines, and the interpreter's own exit
(the figures record it; the bound tells an exit from a hang, on a busy machine too)."""


def _hang(port: int, api_key: str, body: bytes, declared: int) -> socket.socket:
    """A chat request on its own connection: `body`, of a body declared `declared` bytes long."""
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + api_key.encode() + b"\r\ncontent-length: " + str(declared).encode() + b"\r\n\r\n" + body
    )
    return client


def _terminate(server: Served, clients: list[socket.socket], name: str) -> None:
    """SIGTERM the gateway while `clients` are in flight: it exits cleanly within the graceful period and a margin."""
    signalled = time.monotonic()
    server.process.terminate()
    try:
        server.process.wait(GRACEFUL_SHUTDOWN_S + EXIT_MARGIN_S + 60.0)  # a hang guard; the verdict is below
    finally:
        exited = time.monotonic() - signalled
        for client in clients:
            client.close()
    figures = {"exit_s": round(exited, 2), "requests_in_flight": len(clients), "returncode": server.process.returncode}
    record_figures(name, figures)
    assert server.process.returncode == 128 + signal.SIGTERM  # a clean exit: serve() closed its store and engines
    assert exited <= GRACEFUL_SHUTDOWN_S + EXIT_MARGIN_S, f"SIGTERM to exit took {exited:.1f} s"


def test_the_gateway_exits_on_sigterm_with_requests_in_flight(served):
    server = served("gw-term")
    token = server.token()
    with GatewayClient(server.url, token=token) as gateway:
        rollout = gateway.open_rollout(task="term")
    ask(rollout.base_url, rollout.api_key, "1+1")  # it serves
    # Requests that never finish arriving: without a bound, uvicorn's graceful shutdown waits for them forever.
    hanging = [_hang(server.port, rollout.api_key, b'{"model": ', 100_000) for _ in range(4)]
    wait_for(lambda: _held_connections(server.process.pid, server.port) >= len(hanging), "the gateway to hold the hanging requests")
    _terminate(server, hanging, "gateway_sigterm")


def test_the_gateway_exits_on_sigterm_while_big_prompts_are_tokenized(served):
    """Prompts of ~7 MB (every message just under max_message_chars, the body under max_body_bytes) take
    the tokenizer tens of seconds in worker threads; a stop signal must not wait for them."""
    server = served("gw-term-big")
    token = server.token()
    with GatewayClient(server.url, token=token) as gateway:
        rollouts = [gateway.open_rollout(task=f"big-{i}") for i in range(2)]
    content = "ab c" * 249_999  # 999,996 characters, under gateway.max_message_chars
    body = json.dumps({"messages": [{"role": "user", "content": content}] * 7, "max_tokens": 4}).encode()
    big = [_hang(server.port, rollout.api_key, body, len(body)) for rollout in rollouts]
    # Every byte read: the gateway has the whole body, and goes on to validate, render and tokenize it.
    wait_for(lambda: not any(_unsent(c) for c in big), "the big bodies to be sent")
    wait_for(lambda: _held_connections(server.process.pid, server.port, unread=False) >= len(big), "the gateway to read the big bodies")
    _terminate(server, big, "gateway_sigterm_tokenizing")


def _unsent(client: socket.socket) -> int:
    """Bytes of `client`'s sends the gateway's side has not yet acknowledged."""
    return struct.unpack("i", fcntl.ioctl(client.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _held_connections(pid: int, port: int, *, unread: bool = True) -> int:
    """Client connections the gateway process has accepted on `port` and holds open (from /proc); with
    `unread` false, only those it has read every byte of."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (target := os.readlink(fd)).startswith("socket:["):
                sockets.add(target.removeprefix("socket:[").removesuffix("]"))
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state, queues, inode = row.split()[1], row.split()[3], row.split()[4], row.split()[9]
            read_all = unread or int(queues.split(":")[1], 16) == 0
            held += state == "01" and int(local.rsplit(":", 1)[1], 16) == port and inode in sockets and read_all  # 01: ESTABLISHED
    return held
