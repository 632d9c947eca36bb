"""Benchmark: the embedded engine's decode throughput against transformers' `generate()`.

Both sides run the same tiny policy (`policy.tiny`, random weights), the same prompts, the same
number of new tokens and the same sampling (temperature 1, no top-k/top-p), with the same torch
thread count (`torch_threads`, the driver's budget). The model is built without an EOS token, so
neither side can stop early: every request produces exactly NEW_TOKENS tokens. Each measurement is
repeated and the median kept; engine and transformers runs alternate so drift hits both alike.

    asyncrl bench engine --json bench-engine.json
    python -m asyncrl.bench.engine --json bench-engine.json

With `policy.path=SFT_CHECKPOINT`, the same run adds MTP drafting and FP8 measurements
(`asyncrl/bench/engine_mtp.py`): `mtp_accept_len`, `mtp_speedup_b1`, `mtp_speedup_b64`,
`fp8_weight_bytes_ratio`, `fp8_mean_abs_logprob_gap`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from asyncrl.configs.schema import RunConfig

BATCH = 64
PROMPT_TOKENS = 32
NEW_TOKENS = 128
REPEATS = 3


def run(config: RunConfig, json_path: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    from asyncrl.policy.tiny import tiny_model_config
    from asyncrl.rollout import EmbeddedEngine

    from . import engine_mtp

    threads = config.torch_threads
    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(tiny_model_config(config.policy.tiny, eos_token_id=None), dtype=torch.float32).eval()
    rollout = config.rollout.embedded().model_copy(
        update={"torch_threads": threads, "max_num_seqs": max(BATCH, config.rollout.max_num_seqs)}
    )
    engine = EmbeddedEngine(model, rollout, engine_id="bench")
    rng = random.Random(config.seed)
    # Ids 16.. are ordinary characters in the embedded tokenizer; any in-vocabulary ids would do.
    prompts = [[rng.randrange(16, model.config.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]
    engine_b64 = partial(_engine_tok_s, engine, prompts, BATCH)
    hf_b64 = partial(_hf_tok_s, model, prompts, BATCH)
    engine_b1 = partial(_engine_tok_s, engine, prompts, 1)

    b64: list[float] = []
    hf64: list[float] = []
    b1: list[float] = []
    mtp_steps = engine_mtp.REPEATS + 1 if config.policy.path else 0
    with Progress(TextColumn("bench engine"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        task = progress.add_task("measure", total=3 * (REPEATS + 1) + mtp_steps)
        for measure in (engine_b64, hf_b64, engine_b1):
            measure()  # warm-up: allocator, thread pools, kernels
            progress.advance(task)
        for _ in range(REPEATS):
            for runs, measure in ((b64, engine_b64), (hf64, hf_b64), (b1, engine_b1)):
                runs.append(measure())
                progress.advance(task)
        engine.shutdown()
        mtp_results = engine_mtp.run(config, threads, BATCH, progress=lambda: progress.advance(task))

    results = {
        "tok_s_b1": round(statistics.median(b1), 1),
        "tok_s_b64": round(statistics.median(b64), 1),
        "hf_generate_tok_s_b64": round(statistics.median(hf64), 1),
        "speedup_vs_hf_b64": round(statistics.median(b64) / statistics.median(hf64), 2),
        "runs": {"tok_s_b1": b1, "tok_s_b64": b64, "hf_generate_tok_s_b64": hf64},
        "setup": _setup(config, threads),
        **mtp_results,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _engine_tok_s(engine, prompts: list[list[int]], batch: int) -> float:
    """The embedded engine's generated tokens per second over the first `batch` prompts at once."""
    from asyncrl.records import SamplingParams

    async def go():
        params = [SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=i) for i in range(batch)]
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts[:batch], params, strict=True)))

    start = time.perf_counter()
    results = asyncio.run(go())
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == batch * NEW_TOKENS, produced
    return produced / elapsed


def _hf_tok_s(model, prompts: list[list[int]], batch: int) -> float:
    """transformers' `generate()`'s generated tokens per second over the first `batch` prompts, the same sampling."""
    input_ids = torch.tensor(prompts[:batch])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            eos_token_id=None,
        )
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - PROMPT_TOKENS) * batch
    assert produced == batch * NEW_TOKENS, produced
    return produced / elapsed


def _setup(config: RunConfig, threads: int) -> dict:
    """What was measured, and on what, reported beside the numbers."""
    return {
        "arch": config.policy.tiny.arch,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "batch": BATCH,
        "repeats": REPEATS,
        "torch_threads": threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    print(json.dumps(run(RunConfig(), args.json), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
