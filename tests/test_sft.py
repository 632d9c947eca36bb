"""SFT data (assistant-only loss masks, the environments' demonstration mix), held-out evaluation
through the gateway, and a short end-to-end SFT run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from gateway_helpers import scripted_model
from transformers import AutoModelForCausalLM

from asyncrl.configs.loader import load_config
from asyncrl.configs.schema import RunConfig, TinyModelConfig
from asyncrl.envs.arithmetic import ArithmeticTask
from asyncrl.envs.tool_demos import PYTHON_TOOL, ToolProblem, sample_tool_problem
from asyncrl.jobs.sft import HeldOut, demo_stream, run_sft
from asyncrl.learner.sft import next_token_loss, train_step
from asyncrl.learner.sft_data import DemoStream, collate, length_buckets, render_demo
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import mtp_loss, policy_hidden_and_logits
from asyncrl.policy.tokenizer import ASSISTANT, EOS, build_tokenizer

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)


def trained_text(tok, demo) -> list[str]:
    """The maximal runs of tokens the loss mask trains, decoded."""
    runs, current = [], []
    for token, trained in zip(demo.token_ids, demo.loss_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs, current = [*runs, tok.decode(current)], []
    return runs + ([tok.decode(current)] if current else [])


def test_loss_mask_is_one_exactly_on_assistant_tokens():
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "12+34"}, {"role": "assistant", "content": "46"}]
    demo = render_demo(tok, messages)
    assert tok.decode(demo.token_ids) == "<|user|>12+34<|assistant|>46<|endoftext|>"
    assert demo.loss_mask == [0] * 7 + [1, 1, 1]
    assert trained_text(tok, demo) == ["46<|endoftext|>"]


def test_tool_demo_mask_covers_the_call_markup_and_eos_but_not_the_tool_output():
    tok = build_tokenizer()
    messages = ToolProblem(123, 456).demonstration()
    demo = render_demo(tok, messages, tools=[PYTHON_TOOL])
    text = tok.apply_chat_template(messages, tools=[PYTHON_TOOL], tokenize=False)
    assert demo.token_ids == tok.encode(text, add_special_tokens=False)
    assert trained_text(tok, demo) == [
        "<tool_call>python<arg_key>code</arg_key><arg_value>print(123*456)</arg_value></tool_call><|endoftext|>",
        "56088<|endoftext|>",
    ]


def test_stream_mix_buckets_and_collate():
    tok = build_tokenizer()
    stream = demo_stream(RunConfig(sft={"tool_demo_fraction": 0.25}), tok, seed=0)
    demos = stream.batch(400)
    tool_share = sum(tok.decode(d.token_ids).count("<tool_call>") for d in demos) / len(demos)
    assert 0.18 < tool_share < 0.32
    buckets = length_buckets(demos)
    assert sorted(map(id, demos)) == sorted(id(d) for b in buckets for d in b)
    assert all(len(b[-1].token_ids) <= 1.5 * len(b[0].token_ids) for b in buckets)
    batch = collate(demos[:5], tok.pad_token_id)
    lengths = [len(d.token_ids) for d in demos[:5]]
    assert batch["input_ids"].shape == (5, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["loss_mask"] * (1 - batch["attention_mask"])).sum() == 0
    assert demo_stream(RunConfig(sft={"tool_demo_fraction": 0.25}), tok, seed=0).batch(10)[3].token_ids == demos[3].token_ids


def test_the_environments_demonstrations_are_the_warm_starts_mix_draw_for_draw():
    """The stream the SFT entry point builds from the environments is, seed for seed, the one the warm
    start has always drawn: one uniform number picks the source, which then draws with the same generator."""
    tok = build_tokenizer()
    config = RunConfig(sft={"tool_demo_fraction": 0.3})
    arithmetic, rng = ArithmeticTask(config.tasks.arithmetic), random.Random(7)
    expected = []
    for _ in range(200):
        if rng.random() < 0.3:
            expected.append(render_demo(tok, sample_tool_problem(rng).demonstration(), tools=[PYTHON_TOOL]).token_ids)
        else:
            expected.append(render_demo(tok, arithmetic.sample(rng).demonstration()).token_ids)
    assert [d.token_ids for d in demo_stream(config, tok, seed=7).batch(200)] == expected


def test_a_stream_refuses_shares_above_one():
    with pytest.raises(ValueError, match="must not exceed 1"):
        DemoStream(build_tokenizer(), [(0.7, None), (0.4, None)], rest=None, seed=0)


def test_bucketed_step_has_the_gradient_of_one_padded_batch():
    config = RunConfig(policy={"tiny": TinyModelConfig(arch="qwen3", **SMALL)})
    tok = build_tokenizer()
    with_tools = config.model_copy(update={"sft": config.sft.model_copy(update={"tool_demo_fraction": 0.25})})
    demos = demo_stream(with_tools, tok, seed=1).batch(16)
    assert len(length_buckets(demos)) > 1
    model, _, mtp = build_policy(config.policy, seed=0)
    train_step(config, model, mtp, demos, tok.pad_token_id)
    bucketed = [p.grad.clone() for p in list(model.parameters()) + list(mtp.parameters())]

    model, _, mtp = build_policy(config.policy, seed=0)
    batch = collate(demos, tok.pad_token_id)
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    hidden, logits = policy_hidden_and_logits(model, ids, attention)
    # The next-token term by autograd through the full softmax: the step's runs the head at trained tokens only.
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    next_token = (per_token * mask[:, 1:]).sum() / mask[:, 1:].sum()
    assert float(next_token) == pytest.approx(float(next_token_loss(model, hidden, ids, mask)), rel=1e-6)
    loss = next_token + config.policy.mtp.loss_weight * mtp_loss(model, mtp, hidden, ids, attention, mask, config.policy.mtp.train_depth)
    loss.backward()
    for ours, reference in zip(bucketed, [p.grad for p in list(model.parameters()) + list(mtp.parameters())], strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


def test_held_out_evaluation_plays_the_arithmetic_episodes_through_the_gateway():
    """A real model that answers "12" to anything, served by the SFT's embedded engine behind the
    in-process gateway: its accuracy is exactly the share of held-out problems whose answer is 12."""
    tok = build_tokenizer()
    config = load_config(None, ["eval.num_problems=60", "eval.seed=5", "eval.max_tokens=3"])
    model = scripted_model([ASSISTANT, "1", "2", EOS])
    heldout = HeldOut(config, model, tok)
    try:
        accuracy = heldout.accuracy(model.state_dict(), 1)
    finally:
        heldout.close()
    problems = ArithmeticTask(config.tasks.arithmetic).heldout_set(60, 5)
    twelves = sum(p.answer == 12 for p in problems)
    assert twelves == 2 and accuracy == twelves / 60


def test_held_out_evaluation_of_sft_task_plays_that_tasks_episodes_in_its_sandboxes():
    """`sft.task: agentic`: SFT is scored as the RL loop scores the task, its episodes in sandboxes of the
    task's backend and as many as its eval_problems (a random policy answers wrongly, but every episode
    plays: none crashes for want of a sandbox)."""
    overrides = ["tasks.mix={agentic: {env: agentic, eval_problems: 6}}", "sft.task=agentic", "sandbox.backend=process",
                 *(f"policy.tiny.{key}={value}" for key, value in SMALL.items()), "policy.mtp.enabled=false"]  # fmt: skip
    config = load_config(None, overrides)
    model, tok, _ = build_policy(config.policy, config.seed)
    heldout = HeldOut(config, model, tok)
    try:
        accuracy = heldout.accuracy(model.state_dict(), 1)
    finally:
        heldout.close()
    assert heldout.last is not None and heldout.last.num_problems == 6
    assert heldout.last.statuses == {"ok": 6} and accuracy == heldout.last.accuracy


def test_short_sft_run_writes_a_loadable_checkpoint_metrics_and_plot(tmp_path):
    overrides = [f"{k}={v}" for k, v in SMALL.items()]
    config = load_config(None, [f"policy.tiny.{o}" for o in overrides] + [
        f"runs_dir={tmp_path}", "name=t", "sft.max_steps=4", "sft.batch_size=8", "sft.eval_every=2",
        "sft.stop_at_accuracy=null", "eval.num_problems=6", "eval.max_tokens=3",
        "logging.wandb=disabled", "logging.progress=false",
    ])  # fmt: skip
    result = run_sft(config)
    out = tmp_path / "t" / "sft"
    assert result.steps == 4 and result.stop_reason == "max_steps" and result.checkpoint == out / "checkpoint"
    assert 0.0 <= result.accuracy <= 1.0 and result.wall_s > 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"step", "loss", "mtp_loss", "lr", "tokens_per_s"} <= set(evals[0])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForCausalLM.from_pretrained(str(result.checkpoint))
    assert model.config.num_hidden_layers == 2
    assert json.loads((result.checkpoint / "config.json").read_text())["asyncrl"]["step"] == 4


def test_sft_stops_at_the_first_evaluation_reaching_the_target(tmp_path):
    config = load_config(None, [f"policy.tiny.{k}={v}" for k, v in SMALL.items()] + [
        f"runs_dir={tmp_path}", "policy.tiny.arch=qwen3", "sft.max_steps=50", "sft.batch_size=4",
        "sft.eval_every=3", "sft.stop_at_accuracy=0.0", "eval.num_problems=4", "eval.max_tokens=2",
        "policy.mtp.enabled=false", "logging.wandb=disabled", "logging.progress=false",
    ])  # fmt: skip
    result = run_sft(config)
    assert (result.steps, result.stop_reason) == (3, "accuracy")
    assert not (result.checkpoint / "mtp").exists() and not (result.checkpoint / "mtp.safetensors").exists()
