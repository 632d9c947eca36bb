"""Benchmark: the embedded rollout engine on the tiny policy or a real checkpoint, against transformers'
`generate()`, vLLM and this machine's matmul limit.

What the engine side runs (`engine_model.py` says how it is chosen): the tiny policy by default, a real
checkpoint with `policy.path`. Every side gets the same prompts, the same number of new tokens (EOS
ignored: every request makes exactly `new_tokens`), the same sampling (temperature 1, no top-k/top-p, a
seed per request), the same dtype (`bench.dtype`, float32 by default; bfloat16 only where the CPU has
bfloat16 instructions or on a GPU) and the same torch thread count (`torch_threads`). Each measurement runs
once to warm up, then `bench.repeats` times, the sides taking turns; medians are reported. tokens/s = new
tokens / wall time of the whole batch, prefill included ("b64" is `bench.batch`, 64 by default).

Reported: tokens/s at batch 1 and 64 (engine, vLLM; transformers at 64), prefill tokens/s, peak resident
memory, the fraction of the matmul limit measured in the same run, prefill tokens per GRPO group; each field
is described in docs/BENCHMARKS.md ("engine"). The vLLM side is `engine_vllm.py`.

A markdown table is printed and, with `--json`, written beside the JSON. With `policy.path` an SFT
checkpoint of the tiny policy (one with an MTP layer), the same run adds MTP drafting and FP8 (`engine_mtp.py`).

    asyncrl bench engine --json bench-engine.json
    asyncrl bench engine policy.path=smollm2-135m --json bench-engine-smollm2.json
    asyncrl bench engine policy.path=smollm2-135m bench.dtype=bfloat16 --json bench-engine-smollm2-bf16.json
    python -m asyncrl.bench.engine --json bench-engine.json [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

from asyncrl.configs.schema import RunConfig

from .engine_options import EngineBenchOptions

NEW_TOKENS = 128
CHECKPOINT_NEW_TOKENS = 64
ENGINE_WARMUPS = 3
"""The first measures (the engine's), whose warm-up runs the peak memory covers."""


def run(config: RunConfig, json_path: str | None = None, options: EngineBenchOptions | None = None) -> dict:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from asyncrl.rollout import EmbeddedEngine

    from . import engine_model, engine_mtp
    from .engine_vllm import reset_peak_rss, rss_mb

    options = options or EngineBenchOptions()
    kind, mtp_part = engine_model.choose(config, options.model)
    dtype = engine_model.dtype_under_test(options.dtype)
    torch.set_num_threads(config.torch_threads)
    subject = engine_model.load_subject(config, kind, dtype, options.prompt_tokens)
    new_tokens = options.new_tokens or (NEW_TOKENS if kind == "tiny" else CHECKPOINT_NEW_TOKENS)
    prompts = subject.prompts(options.batch)
    scope = "engine build and warm-up runs" if reset_peak_rss() else "process lifetime (/proc/self/clear_refs unavailable)"
    memory = {"rss_before_engine_mb": round(rss_mb(peak=False), 1), "peak_rss_scope": scope}
    engine = EmbeddedEngine(subject.model, _rollout(config, options, kind, subject.model), engine_id="bench", dtype=dtype)
    columns = (TextColumn("bench engine: {task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp, Progress(*columns) as progress:
        task = progress.add_task("prefill per GRPO group", total=None)
        group = _prefill_per_group(engine, subject, options.group_size, new_tokens)
        progress.update(task, description="vLLM start-up")
        side, vllm = _start_vllm(config, options, subject, prompts, new_tokens, engine.device, Path(tmp))
        measures = _measures(engine, subject, options, prompts, new_tokens, side, vllm)
        steps = len(measures) * (options.repeats + 1) + (engine_mtp.REPEATS + 1 if mtp_part else 0)
        progress.update(task, total=steps, completed=0)
        runs = _measure(measures, options.repeats, progress, task, lambda: memory.update(peak_rss_mb=round(rss_mb(), 1)))
        engine.shutdown()
        if side is not None and "vllm_note" not in vllm:
            vllm.update(side.close())
        progress.update(task, description="MTP drafting and FP8" if mtp_part else "done")
        advance = partial(progress.advance, task)
        mtp_results = engine_mtp.run(config, config.torch_threads, options.batch, progress=advance) if mtp_part else {}
    if engine.device.type == "cuda":
        memory["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    results = _results(runs, engine_model.flops_per_token(subject.model), memory, vllm, group)
    results["setup"] = _setup(config, options, subject, engine, prompts, new_tokens, vllm)
    results.update(mtp_results or {"mtp_note": _mtp_note(config.policy.path)})
    table = _table(results)
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
        Path(json_path).with_suffix(".md").write_text(table + "\n")
    return results


def _rollout(config: RunConfig, options: EngineBenchOptions, kind: str, model):
    update = {"torch_threads": config.torch_threads, "max_num_seqs": max(options.batch, options.group_size, config.rollout.max_num_seqs)}
    if kind == "checkpoint" and config.rollout.max_model_len is None:
        update["max_model_len"] = _model_len(model, options)
    return config.rollout.embedded().model_copy(update=update)


def _model_len(model, options: EngineBenchOptions) -> int:
    return min(options.max_model_len, getattr(model.config, "max_position_embeddings", None) or options.max_model_len)


def _measures(engine, subject, options: EngineBenchOptions, prompts, new_tokens: int, side, vllm: dict) -> dict[str, Callable[[], dict]]:
    """Measurement name -> a function running it once and returning its figures; the engine's first (ENGINE_WARMUPS)."""
    from . import engine_model

    salts = iter(range(1, 1_000_000))
    measures: dict[str, Callable[[], dict]] = {
        "engine b64": lambda: {"tok_s_b64": len(prompts) * new_tokens / _engine_pass(engine, prompts, new_tokens)},
        "engine b1": lambda: {"tok_s_b1": new_tokens / _engine_pass(engine, prompts[:1], new_tokens)},
        "engine prefill": partial(_prefill, engine, subject, len(prompts), salts),
    }
    if options.hf_generate:
        measures["generate() b64"] = partial(_hf_pass, subject.model, prompts, new_tokens, engine.device)
    if side is not None:
        measures["vLLM b64"] = partial(_vllm_pass, side, vllm, len(prompts), "vllm_tok_s_b64")
        measures["vLLM b1"] = partial(_vllm_pass, side, vllm, 1, "vllm_tok_s_b1")
    dtype = engine_model.DTYPES[options.dtype]
    measures["matmul"] = lambda: {
        f"matmul_{name}_gflop_s": value
        for name, value in engine_model.matmul_gflop_s(subject.model, len(prompts), options.matmul_size, dtype, engine.device).items()
    }
    return measures


def _measure(measures: dict[str, Callable[[], dict]], repeats: int, progress, task, after_engine_warmups: Callable[[], None]) -> dict:
    """One warm-up of each measure, then `repeats` rounds of all in turn; the timed figures, name -> runs."""
    runs: dict[str, list[float]] = defaultdict(list)
    for round_ in range(repeats + 1):
        for i, (name, measure) in enumerate(measures.items()):
            if round_ == 0 and i == ENGINE_WARMUPS:
                after_engine_warmups()
            progress.update(task, description=name if round_ else f"{name} (warm-up)")
            figures = measure()
            for key, value in figures.items() if round_ else ():
                runs[key].append(value)
            progress.advance(task)
    return dict(runs)


def _sampling(max_tokens: int, seed: int):
    """Temperature 1, no truncation, EOS ignored (`ignore_eos` where the engine's SamplingParams has it; the bench
    also builds the model without EOS, which is what the engine stops on today)."""
    from asyncrl.records import SamplingParams

    ignore = {"ignore_eos": True} if "ignore_eos" in SamplingParams.__dataclass_fields__ else {}
    return SamplingParams.from_dict({"temperature": 1.0, "max_tokens": max_tokens, "seed": seed, **ignore})


def _engine_pass(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Wall seconds of the engine generating `max_tokens` for every prompt at once; exactly that many, or an error."""

    async def go():
        return await asyncio.gather(*(engine.generate(p, _sampling(max_tokens, i)) for i, p in enumerate(prompts)))

    start = time.perf_counter()
    results = asyncio.run(go())
    elapsed = time.perf_counter() - start
    for result in results:
        if len(result.token_ids) != max_tokens:
            raise RuntimeError(
                f"the engine made {len(result.token_ids)} tokens, not {max_tokens} ({result.finish_reason}: {result.error}); "
                "the bench needs requests that ignore EOS"
            )
    return elapsed


def _prefill(engine, subject, batch: int, salts) -> dict:
    """Prompt tokens per second of `batch` prompts never seen before, one new token each; and the tokens the engine
    ran through prefill forwards per second, where its health() counts them (shared prefixes computed once)."""
    prompts = subject.prompts(batch, salt=next(salts))
    before = engine.health().get("prefill_tokens")
    elapsed = _engine_pass(engine, prompts, 1)
    computed = {} if before is None else {"prefill_computed_tok_s": (engine.health()["prefill_tokens"] - before) / elapsed}
    return {"prefill_tok_s": sum(map(len, prompts)) / elapsed, **computed}


def _prefill_per_group(engine, subject, size: int, new_tokens: int) -> float | None:
    """Prompt tokens the engine prefilled for a group of `size` requests of one fresh prompt, in prompts; None where
    its health() has no `prefill_tokens`."""
    before = engine.health().get("prefill_tokens")
    if before is None:
        return None
    prompt = subject.prompts(1, salt=-1)[0]
    _engine_pass(engine, [prompt] * size, new_tokens)
    return round((engine.health()["prefill_tokens"] - before) / len(prompt), 3)


def _hf_pass(model, prompts: list[list[int]], new_tokens: int, device) -> dict:
    """transformers' `generate()`'s generated tokens per second over `prompts` (left-padded), the same sampling."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.to(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - width) * len(prompts)
    assert produced == len(prompts) * new_tokens, produced
    return {"hf_generate_tok_s_b64": produced / elapsed}


def _start_vllm(config: RunConfig, options: EngineBenchOptions, subject, prompts, new_tokens: int, device, workdir: Path):
    """(the vLLM side, or None; what it reports beside its speeds, with `vllm_note` where it does not run)."""
    from asyncrl.rollout.vllm_compat import SPARSE_ATTENTION_FAMILIES

    from .engine_vllm import VLLMSide, vllm_python

    python, model_type = vllm_python(options.vllm_python), subject.model.config.model_type
    if not options.vllm:
        return None, {"vllm_note": "not run (bench.vllm=false)"}
    if not python.exists():
        return None, {"vllm_note": f"skipped: no vLLM environment ({python} is absent; scripts/setup_vllm_env.sh makes .venv-vllm)"}
    if model_type in SPARSE_ATTENTION_FAMILIES and device.type == "cpu":
        return None, {"vllm_note": f"skipped: {model_type} uses DSA sparse attention, which vLLM's CPU backend lacks"}
    directory = config.policy.path if subject.kind == "checkpoint" else workdir / "model"
    if subject.kind == "tiny":
        subject.model.save_pretrained(str(directory))
    spec = dict(
        model=str(directory), dtype=options.dtype, max_model_len=_model_len(subject.model, options), threads=config.torch_threads,
        seed=config.seed, prompts=prompts, new_tokens=new_tokens, kv_cache_gb=options.vllm_kv_cache_gb,
    )  # fmt: skip
    try:
        return VLLMSide(python, spec, workdir), {}
    except RuntimeError as error:
        return None, {"vllm_note": f"failed: {error}"}


def _vllm_pass(side, vllm: dict, batch: int, key: str) -> dict:
    if "vllm_note" in vllm:  # failed in an earlier measurement: the engine's figures still stand
        return {}
    try:
        return {key: side.tok_s(batch)}
    except RuntimeError as error:
        vllm["vllm_note"] = f"failed: {error}"
        return {}


def _results(runs: dict[str, list[float]], flops: int, memory: dict, vllm: dict, group: float | None) -> dict:
    median = {key: statistics.median(values) for key, values in runs.items()}

    def get(key: str, digits: int = 1):
        return round(median[key], digits) if key in median else None

    def ratio(a: str, b: str):
        return round(median[a] / median[b], 2) if a in median and b in median else None

    limit = max(median["matmul_decode_gflop_s"], median["matmul_square_gflop_s"])
    achieved = {key: median[key] * flops / 1e9 for key in ("tok_s_b64", "prefill_tok_s", "vllm_tok_s_b64") if key in median}
    if "prefill_computed_tok_s" in median:  # the FLOPs prefill did: shared prefix blocks are not computed again
        achieved["prefill_tok_s"] = median["prefill_computed_tok_s"] * flops / 1e9
    return {
        "tok_s_b1": get("tok_s_b1"), "tok_s_b64": get("tok_s_b64"), "hf_generate_tok_s_b64": get("hf_generate_tok_s_b64"),
        "speedup_vs_hf_b64": ratio("tok_s_b64", "hf_generate_tok_s_b64"), "prefill_tok_s": get("prefill_tok_s"),
        "prefill_computed_tok_s": get("prefill_computed_tok_s"),
        "vllm_tok_s_b64": get("vllm_tok_s_b64"), "vllm_tok_s_b1": get("vllm_tok_s_b1"),
        "engine_over_vllm_b64": ratio("tok_s_b64", "vllm_tok_s_b64"), "engine_over_vllm_b1": ratio("tok_s_b1", "vllm_tok_s_b1"),
        "vllm_peak_rss_mb": vllm.get("peak_rss_mb"), "vllm_note": vllm.get("vllm_note"),
        "peak_rss_mb": memory["peak_rss_mb"], "rss_before_engine_mb": memory["rss_before_engine_mb"],
        "peak_rss_scope": memory["peak_rss_scope"], "peak_gpu_mb": memory.get("peak_gpu_mb"),
        "flops_per_token": flops, "gflop_s_b64": round(achieved["tok_s_b64"], 2),
        "matmul_gflop_s": {"decode": get("matmul_decode_gflop_s"), "square": get("matmul_square_gflop_s")},
        "matmul_limit_gflop_s": round(limit, 1), "matmul_fraction_b64": round(achieved["tok_s_b64"] / limit, 4),
        "matmul_fraction_prefill": round(achieved["prefill_tok_s"] / limit, 4),
        "vllm_matmul_fraction_b64": round(achieved["vllm_tok_s_b64"] / limit, 4) if "vllm_tok_s_b64" in achieved else None,
        "prefill_tokens_per_group": group,
        "group_note": None if group is not None else "the engine's health() reports no prefill_tokens (prefix sharing not there yet)",
        "runs": runs,
    }  # fmt: skip


def _setup(config: RunConfig, options: EngineBenchOptions, subject, engine, prompts, new_tokens: int, vllm: dict) -> dict:
    """What was measured, and on what, reported beside the numbers."""
    import torch

    from asyncrl.policy.hardware import cpu_has_bf16

    lengths = [len(p) for p in prompts]
    return {
        "model": subject.kind, "source": config.policy.path if subject.kind == "checkpoint" else "policy.tiny",
        "arch": subject.model.config.model_type, "parameters": sum(p.numel() for p in subject.model.parameters()),
        "dtype": options.dtype, "device": str(engine.device), "prompt_tokens": round(sum(lengths) / len(lengths), 1),
        "prompt_tokens_max": max(lengths), "new_tokens": new_tokens, "batch": options.batch, "repeats": options.repeats,
        "group_size": options.group_size, "max_model_len": engine.max_model_len, "torch_threads": config.torch_threads,
        "torch": torch.__version__, "machine": platform.machine(), "cpu_bf16": cpu_has_bf16(),
        "vllm": {key: vllm[key] for key in ("version", "startup_s", "environment") if key in vllm} or None,
    }  # fmt: skip


def _mtp_note(path: str | None) -> str:
    if path is None:
        return "set policy.path to an SFT checkpoint (asyncrl sft quickstart) to measure MTP and FP8"
    return f"{path} has no MTP layer: MTP drafting and FP8 are measured on SFT checkpoints that have one"


def _table(r: dict) -> str:
    """The figures as a markdown table: a row per measurement, a column per side."""

    def cell(value, unit: str = "") -> str:
        return "-" if value is None else f"{value:,.1f}{unit}" if isinstance(value, float) else f"{value:,}{unit}"

    def fraction(key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.3g}"

    setup, b = r["setup"], r["setup"]["batch"]
    title = f"{setup['arch']} ({setup['model']}), {setup['dtype']}, {setup['torch_threads']} threads, {setup['new_tokens']} new tokens"
    rows = [
        ("tokens/s, batch 1", cell(r["tok_s_b1"]), cell(r["vllm_tok_s_b1"]), "-"),
        (f"tokens/s, batch {b}", cell(r["tok_s_b64"]), cell(r["vllm_tok_s_b64"]), cell(r["hf_generate_tok_s_b64"])),
        (f"engine's tokens/s over the side's, batch {b}", "-", fraction("engine_over_vllm_b64"), fraction("speedup_vs_hf_b64")),
        (f"prefill tokens/s, batch {b}", cell(r["prefill_tok_s"]), "-", "-"),
        (f"fraction of the matmul limit, batch {b}", fraction("matmul_fraction_b64"), fraction("vllm_matmul_fraction_b64"), "-"),
        ("peak resident memory", cell(r["peak_rss_mb"], " MB"), cell(r["vllm_peak_rss_mb"], " MB"), "-"),
    ]
    lines = [f"**{title}**", "", "| | embedded engine | vLLM | transformers generate() |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    limit = r["matmul_gflop_s"]
    lines += [
        "",
        f"matmul limit {r['matmul_limit_gflop_s']} GFLOP/s (decode-shaped {limit['decode']}, square {limit['square']}); "
        f"{r['flops_per_token'] / 1e9:.3f} GFLOP a token; prefill tokens per GRPO group: {cell(r['prefill_tokens_per_group'])}"
        + (f"; vLLM: {r['vllm_note'].splitlines()[0]}" if r["vllm_note"] else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from . import BENCHMARKS

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides; bench.KEY=VALUE the bench's own")
    args = parser.parse_args(argv)
    config, options = BENCHMARKS["engine"].resolve(None, args.overrides)
    print(json.dumps(run(config, args.json, options), indent=2))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
