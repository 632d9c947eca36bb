"""SFT data (assistant-only loss masks), held-out evaluation, and a short end-to-end SFT run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.configs.loader import load_config
from asyncrl.configs.schema import ArithmeticTaskConfig, EvalConfig, RunConfig, TinyModelConfig
from asyncrl.envs.arithmetic import ArithmeticTask
from asyncrl.envs.tool_demos import PYTHON_TOOL, ToolProblem
from asyncrl.learner.evaluate import evaluate_arithmetic, hf_greedy_generate
from asyncrl.learner.sft import next_token_loss, run_sft, train_step
from asyncrl.learner.sft_data import DemoStream, collate, length_buckets, render_demo
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import mtp_loss, policy_hidden_and_logits
from asyncrl.policy.tiny import build_tiny_model
from asyncrl.policy.tokenizer import build_tokenizer

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)


def trained_text(tok, demo) -> list[str]:
    """The maximal runs of tokens the loss mask trains, decoded."""
    runs, current = [], []
    for token, trained in zip(demo.token_ids, demo.loss_mask):
        if trained:
            current.append(token)
        elif current:
            runs, current = runs + [tok.decode(current)], []
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
    stream = DemoStream(tok, ArithmeticTaskConfig(), tool_demo_fraction=0.25, seed=0)
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
    assert DemoStream(tok, ArithmeticTaskConfig(), 0.25, seed=0).batch(10)[3].token_ids == demos[3].token_ids


def test_bucketed_step_has_the_gradient_of_one_padded_batch():
    config = RunConfig(policy={"tiny": TinyModelConfig(arch="qwen3", **SMALL)})
    tok = build_tokenizer()
    demos = DemoStream(tok, config.tasks.arithmetic, 0.25, seed=1).batch(16)
    assert len(length_buckets(demos)) > 1
    model, _, mtp = build_policy(config.policy, seed=0)
    train_step(config, model, mtp, demos, tok.pad_token_id)
    bucketed = [p.grad.clone() for p in list(model.parameters()) + list(mtp.parameters())]

    model, _, mtp = build_policy(config.policy, seed=0)
    batch = collate(demos, tok.pad_token_id)
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    hidden, logits = policy_hidden_and_logits(model, ids, attention)
    loss = next_token_loss(logits, ids, mask) + config.policy.mtp.loss_weight * mtp_loss(
        model, mtp, hidden, ids, attention, mask, config.policy.mtp.train_depth
    )
    loss.backward()
    for ours, reference in zip(bucketed, [p.grad for p in list(model.parameters()) + list(mtp.parameters())]):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_batched_greedy_matches_one_prompt_at_a_time_and_hf_generate(arch):
    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(arch=arch, **SMALL), seed=0).eval()
    generate = hf_greedy_generate(model, tok.eos_token_id, tok.pad_token_id, batch_size=3)
    texts = ["<|user|>1+2<|assistant|>", "<|user|>What is 45 minus 3?<|assistant|>", "<|user|>99+1<|assistant|>"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts] * 2
    batched = generate(prompts, 6)
    assert batched == [generate([p], 6)[0] for p in prompts]
    with torch.no_grad():
        reference = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):] for p in prompts]
    for ours, theirs in zip(batched, reference):
        assert ours == theirs.tolist()[: len(ours)]


def test_evaluation_scores_the_callable_it_is_given():
    tok = build_tokenizer()
    task, config = ArithmeticTaskConfig(), EvalConfig(num_problems=20, seed=5)
    problems = ArithmeticTask(task).heldout_set(20, 5)
    answers = {tuple(tok.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=False).encode()): p
                for p in problems}  # fmt: skip

    def oracle(prompts, max_tokens):
        assert max_tokens == config.max_tokens
        return [tok.encode(f"{answers[tuple(tok.decode(p).encode())].answer}<|endoftext|>") for p in prompts]

    assert evaluate_arithmetic(oracle, tok, task, config).accuracy == 1.0
    wrong = evaluate_arithmetic(lambda prompts, n: [tok.encode("-1")] * len(prompts), tok, task, config)
    assert wrong.accuracy == 0.0 and wrong.num_problems == 20 and wrong.examples


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
