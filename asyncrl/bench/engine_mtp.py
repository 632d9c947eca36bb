"""`asyncrl bench engine`, second part: MTP drafting and FP8 weights in the embedded engine.

Measured on an SFT checkpoint (`policy.path`, e.g. from `asyncrl sft quickstart`): the MTP layer
is only worth drafting with once trained, and its acceptance depends on how well the policy knows
the tasks. Prompts are the built-in tasks' (`task_prompts`), rendered by the checkpoint's chat
template. Sampling is the RL setting, temperature 1.

- `mtp_accept_len`: tokens emitted per verify step (accepted drafts + 1) at 4 draft tokens, over
  every request; per task too. The first token (from prefill) is no verify step and not counted; a
  step cut short by a stop token or max_tokens counts the tokens it emitted
  (`accept_len_before_stop` counts what the rejection rule accepted in those steps instead).
- `mtp_speedup_b1` / `mtp_speedup_b64`: generated tokens per second with drafting over without,
  requests one at a time / 64 at once, sides alternating in order, medians of REPEATS. Each side
  samples its own tokens (same seeds, different random streams), so token counts differ a little.
  The same runs per CPU second of this process (`speedup_*_cpu_time`) are steadier on a shared
  machine, where wall-clock time also counts waiting for a core.
- `fp8_weight_bytes_ratio`: the engine's policy weights with FP8 linears (1 byte + a float32 scale
  per output row; the rest, embeddings, norms, router and LM head, at 2 bytes) over all at bf16.
- `fp8_mean_abs_logprob_gap`: mean |rollout log-prob - learner log-prob| over tokens sampled by the
  FP8 engine, the learner being the full-precision transformers forward (fp32 engine for reference).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import torch

from asyncrl.configs.schema import RunConfig

DRAFT_TOKENS = 4
MAX_TOKENS = 96
REPEATS = 3
B1_PROMPTS = 10


def task_prompts(config: RunConfig, tokenizer, count: int) -> list[tuple[str, list[int]]]:
    """(task, prompt ids) from the built-in task mix (configs/mixed.yaml: reasoning 3, agentic 1).

    Held-out problems of both. An agentic episode generates twice, so each contributes two prompts:
    the tool call after the question ("tool_call"), and the answer after the tool's output
    ("tool_answer", rendered from the SFT demonstration's conversation up to the tool message).
    """
    from asyncrl.envs.agentic import AgenticEnv
    from asyncrl.envs.arithmetic import ArithmeticTask
    from asyncrl.envs.tool_demos import PYTHON_TOOL

    episodes = round(count / 5)  # 3 arithmetic requests : 1 agentic episode of 2 requests
    arithmetic = ArithmeticTask(config.tasks.arithmetic).heldout_set(count - 2 * episodes, config.seed)
    agentic, rng = AgenticEnv(config.tasks.agentic), random.Random(config.seed)
    rendered = [("arithmetic", tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True)) for p in arithmetic]
    for _ in range(episodes):
        problem = agentic.sample_task(rng, "eval")
        before_answer = problem.demonstration()[:-1]
        for task, messages in (("tool_call", problem.messages()), ("tool_answer", before_answer)):
            ids = tokenizer.apply_chat_template(messages, tools=[PYTHON_TOOL], add_generation_prompt=True)
            rendered.append((task, ids))
    return [(task, list(ids["input_ids"] if hasattr(ids, "keys") else ids)) for task, ids in rendered]


def _generate(engine, prompts: list[list[int]], temperature: float = 1.0):
    async def go():
        params = [dict(temperature=temperature, max_tokens=MAX_TOKENS, seed=i) for i in range(len(prompts))]
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))

    return asyncio.run(go())


def _tok_s(engine, prompts: list[list[int]], batch: int) -> tuple[float, float]:
    """(generated tokens per wall-clock second, per CPU second of this process)."""
    start, cpu_start, produced = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(prompts), batch):
        produced += sum(len(r.token_ids) for r in _generate(engine, prompts[i : i + batch]))
    return produced / (time.perf_counter() - start), produced / (time.process_time() - cpu_start)


def _learner_gap(model, results) -> float:
    """Mean |engine log-prob - full-precision transformers log-prob| over every sampled token."""
    gaps = []
    with torch.inference_mode():
        for r in results:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids])
            logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
            gaps.append((torch.tensor(r.logprobs) - ref).abs())
    return torch.cat(gaps).mean().item()


def run(config: RunConfig, threads: int, batch: int, progress=None) -> dict:
    from asyncrl.policy.checkpoint import load_policy
    from asyncrl.rollout import EmbeddedEngine
    from asyncrl.rollout.fp8 import weight_bytes

    if config.policy.path is None:
        return {"mtp_note": "set policy.path to an SFT checkpoint (asyncrl sft quickstart) to measure MTP and FP8"}
    model, tokenizer, mtp = load_policy(config.policy.path)
    model = model.float().eval()
    if mtp is None:
        raise SystemExit(f"bench engine: {config.policy.path} has no MTP layer to draft with")
    base = _base_config(config, threads, batch)
    plain = EmbeddedEngine(model, base, engine_id="plain")
    drafting = EmbeddedEngine(
        model, base.model_copy(update={"mtp_drafting": True, "mtp_draft_tokens": DRAFT_TOKENS}), engine_id="mtp", mtp=mtp
    )
    fp8 = EmbeddedEngine(model, base.model_copy(update={"fp8": True}), engine_id="fp8")
    tasks_and_prompts = task_prompts(config, tokenizer, batch)
    prompts = [p for _, p in tasks_and_prompts]
    b1_prompts = [p for _, p in task_prompts(config, tokenizer, B1_PROMPTS)]  # the same mix, fewer

    accept_len, acceptance = _acceptance(model, mtp, drafting, tasks_and_prompts)
    if progress:
        progress()
    sides, cpu_sides = _speeds(plain, drafting, prompts, b1_prompts, batch, progress)
    median = {k: statistics.median(v) for k, v in sides.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu_sides.items()}

    fp8_bytes = weight_bytes(fp8.model.weights, skip=frozenset({"expand"}))
    bf16_bytes = weight_bytes(plain.model.weights, skip=frozenset({"expand"}))
    fp8_gap = _learner_gap(model, _generate(fp8, prompts))
    fp32_gap = _learner_gap(model, _generate(plain, prompts))
    for engine in (plain, drafting, fp8):
        engine.shutdown()
    return {
        "mtp_accept_len": round(accept_len, 3),
        "mtp_speedup_b1": round(median["b1_mtp"] / median["b1_plain"], 2),
        "mtp_speedup_b64": round(median["b64_mtp"] / median["b64_plain"], 2),
        "fp8_weight_bytes_ratio": round(fp8_bytes / bf16_bytes, 3),
        "fp8_mean_abs_logprob_gap": round(fp8_gap, 5),
        "mtp_details": {
            "draft_tokens": DRAFT_TOKENS,
            **acceptance,
            "tok_s_medians": {k: round(v, 1) for k, v in median.items()},
            "runs": sides,
            "speedup_b1_cpu_time": round(cpu_median["b1_mtp"] / cpu_median["b1_plain"], 2),
            "speedup_b64_cpu_time": round(cpu_median["b64_mtp"] / cpu_median["b64_plain"], 2),
            "tok_per_cpu_s_medians": {k: round(v, 1) for k, v in cpu_median.items()},
            "checkpoint": config.policy.path,
            "prompts": len(prompts),
            "b1_prompts": len(b1_prompts),
            "max_tokens": MAX_TOKENS,
        },
        "fp8_details": {
            "weight_bytes_fp8": fp8_bytes,
            "weight_bytes_bf16": bf16_bytes,
            "fp32_engine_mean_abs_logprob_gap": fp32_gap,
        },
    }


def _base_config(config: RunConfig, threads: int, batch: int):
    base = config.rollout.embedded()
    # No prefix kept for a session's next turn (the slot cache's setting; the paged cache has none).
    retained = {"retained_prefixes": 0} if "retained_prefixes" in type(base).model_fields else {}
    return base.model_copy(update={"torch_threads": threads, "max_num_seqs": batch, **retained})


def _acceptance(model, mtp, drafting, tasks_and_prompts: list[tuple[str, list[int]]]) -> tuple[float, dict]:
    """The drafting engine's acceptance length over every prompt, and its details: per task, before stop tokens, and
    greedy (a fresh drafting engine at temperature 0)."""
    from asyncrl.rollout import EmbeddedEngine

    results = _generate(drafting, [p for _, p in tasks_and_prompts])
    per_task = {}
    for task in dict.fromkeys(t for t, _ in tasks_and_prompts):
        mine = [r for (t, _), r in zip(tasks_and_prompts, results, strict=True) if t == task and r.mtp_verify_steps]
        steps = sum(r.mtp_verify_steps for r in mine)
        emitted = sum(r.mtp_accept_len * r.mtp_verify_steps for r in mine)
        per_task[task] = round(emitted / steps, 3) if steps else None
    accept_len = drafting.health()["mtp_accept_len"]
    before_stop = drafting.verify_tokens_before_stop / drafting.verify_steps
    greedy_engine = EmbeddedEngine(model, drafting.config, engine_id="mtp-greedy", mtp=mtp)
    _generate(greedy_engine, [p for _, p in tasks_and_prompts], temperature=0.0)
    greedy_accept = greedy_engine.health()["mtp_accept_len"]
    greedy_engine.shutdown()
    details = {
        "accept_len_by_task": per_task,
        "accept_len_before_stop": round(before_stop, 3),
        "accept_len_greedy": round(greedy_accept, 3),
    }
    return accept_len, details


def _speeds(plain, drafting, prompts: list[list[int]], b1_prompts: list[list[int]], batch: int, progress=None) -> tuple[dict, dict]:
    """Generated tokens per wall-clock second and per CPU second of each side ("b1_plain", "b1_mtp", "b64_plain",
    "b64_mtp"), REPEATS runs each after a warm-up."""
    sides: dict[str, list[float]] = {"b1_plain": [], "b1_mtp": [], "b64_plain": [], "b64_mtp": []}
    cpu_sides: dict[str, list[float]] = {k: [] for k in sides}
    _tok_s(plain, prompts, batch), _tok_s(drafting, prompts, batch)  # warm-up
    for repeat in range(REPEATS):
        # Alternate which side goes first, so a load change between the two hits both alike.
        order = ("plain", "mtp") if repeat % 2 == 0 else ("mtp", "plain")
        for size, measured, chunk in (("b1", b1_prompts, 1), ("b64", prompts, batch)):
            for side in order:
                wall, cpu = _tok_s(plain if side == "plain" else drafting, measured, chunk)
                sides[f"{size}_{side}"].append(wall)
                cpu_sides[f"{size}_{side}"].append(cpu)
        if progress:
            progress()
    return sides, cpu_sides
