"""The GPU checks behind scripts/gpu_smoke.sh, each measured side by side in this one process.

1. The embedded engine on the device: log-probs of what it samples against transformers' full forward
   on the CPU (a native family and a generic one), then decode throughput of a generated Llama-shaped
   model, native forward against the generic path, same requests.
2. The learner on the device: one step against the same step on the CPU (loss, weights), then
   samples/s and peak device memory on synthetic GRPO batches, with and without gradient checkpointing,
   and its push (the weights copied out for the engines) against the copy bandwidth, and the broadcast
   push to an engine's process (NCCL), bit for bit and timed; then a generated Qwen3 with a real
   vocabulary (151,936 words), its logits in chunks and in one buffer: samples/s and peak memory.
3. Where Ray is installed: `asyncrl run quickstart` with the learner and the engine on the device for
   `--run-seconds`, its held-out accuracy before and after and its samples/s.

Writes gpu_smoke.json to --out and prints one line per figure. `--device cpu` runs the same code on
the CPU (how the script is tested on machines without a GPU; the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family checkpoints (tests/families.py)
sys.path.insert(0, str(ROOT / "scripts"))  # make_checkpoint.py


def say(results: dict, key: str, value) -> None:
    results[key] = value
    print(f"[gpu-smoke] {key}: {value}", flush=True)


SCALE = {
    "full": dict(requests=64, prompt=256, decode=128, groups=16, reply=384),
    "quick": dict(requests=4, prompt=16, decode=8, groups=2, reply=16),
}
"""Sizes of the throughput figures; `quick` only exercises the code (the script's own test)."""


def engine_checks(device: str, results: dict, size: int, scale: dict) -> None:
    from conftest import run_to_completion
    from families import tiny_family_model
    from test_engine_numerics import PROMPTS, hf_logprobs
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.configs.schema import EmbeddedRolloutConfig
    from asyncrl.records import SamplingParams
    from asyncrl.rollout import EmbeddedEngine
    from asyncrl.rollout.models import ARCHITECTURES

    for family in ("llama", "gpt2"):
        model = tiny_family_model(family)
        engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, device=device))
        runs = run_to_completion(engine, [(p, SamplingParams(temperature=1.0, max_tokens=16, seed=1)) for p in PROMPTS])
        engine.shutdown()
        gap = max(float((torch.tensor(r.logprobs) - hf_logprobs(model, r.prompt_token_ids, r.token_ids)).abs().max()) for r in runs)
        say(results, f"engine_{family}_{type(engine.model).__name__}_max_logprob_gap", gap)

    config = AutoConfig.for_model(
        "llama", vocab_size=32000, hidden_size=size, num_hidden_layers=8, num_attention_heads=size // 64, num_key_value_heads=size // 128,
        intermediate_size=size * 4, max_position_embeddings=2048, eos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32).eval()
    prompts = [[(7 * i + j) % 31000 + 10 for j in range(scale["prompt"])] for i in range(scale["requests"])]
    params = SamplingParams(temperature=1.0, max_tokens=scale["decode"], seed=3)
    for path in ("native", "generic", "native", "generic"):
        native = ARCHITECTURES.pop("llama") if path == "generic" else None
        try:
            engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=64, device=device))
        finally:
            if native is not None:
                ARCHITECTURES["llama"] = native
        run_to_completion(engine, [(prompts[0], SamplingParams(temperature=1.0, max_tokens=4, seed=1))])  # warm-up
        start = time.perf_counter()
        done = run_to_completion(engine, [(p, params) for p in prompts])
        wall = time.perf_counter() - start
        engine.shutdown()
        results.setdefault(f"engine_{path}_tokens_per_s", []).append(sum(len(r.token_ids) for r in done) / wall)
    for path in ("native", "generic"):
        say(results, f"engine_{path}_tokens_per_s", [round(x) for x in results[f"engine_{path}_tokens_per_s"]])


def learner_checks(device: str, results: dict, size: int, scale: dict) -> None:
    from test_learner_dp import batch, config

    from asyncrl.bench.learner import LearnerBenchOptions
    from asyncrl.configs import load_config
    from asyncrl.learner.rl import RLLearner

    def learner(run, where: str) -> RLLearner:
        return RLLearner.from_config(run.model_copy(update={"learner": run.learner.model_copy(update={"device": where})}))

    tiny = config(1)
    on_cpu, on_device = learner(tiny, "cpu"), learner(tiny, device)
    one, two = on_cpu.train_step(batch()), on_device.train_step(batch())
    gap = max(
        float((a - b.cpu()).abs().max())
        for a, b in zip(on_cpu.model.state_dict().values(), on_device.model.state_dict().values(), strict=True)
    )
    say(results, "learner_step_loss_cpu_vs_device", [one.loss, two.loss])
    say(results, "learner_step_max_weight_gap", gap)

    shape = ["policy.tiny.arch=qwen3", f"policy.tiny.hidden_size={size}", "policy.tiny.num_layers=8", f"policy.tiny.num_heads={size // 64}",
             f"policy.tiny.intermediate_size={size * 4}", "policy.tiny.max_position_embeddings=2048", "policy.mtp.enabled=false",
             f"learner.batch_groups={scale['groups']}", "learner.group_size=8"]  # fmt: skip
    if device == "cuda":  # the generated policy is float32, which no one trains on a GPU
        shape.append("policy.dtype=bfloat16")
    options = LearnerBenchOptions(prompt_tokens=scale["prompt"], reply_tokens=scale["reply"])
    for checkpointing in (False, True):
        run = load_config("quickstart", [*shape, f"learner.gradient_checkpointing={str(checkpointing).lower()}"])
        trainer = learner(run, device)
        time_steps(trainer, run, options, device, results, "learner_" + ("checkpointed" if checkpointing else "plain"))
        if not checkpointing:
            push_check(trainer, device, results)
            broadcast_check(trainer, device, results)
        del trainer


def wide_vocabulary_check(device: str, results: dict, out: Path, scale: dict) -> None:
    """The learner on a generated Qwen3 with a real vocabulary (151,936 words), where the logits, not the
    decoder, set the memory: samples/s and peak memory with the head's logits in chunks of 2048 positions
    (the default) and in one buffer per micro-batch (asyncrl/policy/token_logprobs.py)."""
    from make_checkpoint import write_checkpoint

    from asyncrl.bench.learner import LearnerBenchOptions
    from asyncrl.configs import load_config
    from asyncrl.learner.rl import RLLearner

    write_checkpoint(out / "qwen3-wide", hidden_size=256 if scale is SCALE["quick"] else 1024, layers=4)
    options = LearnerBenchOptions(prompt_tokens=scale["prompt"], reply_tokens=scale["reply"])
    for name, chunk in (("chunked", 2048), ("one_buffer", 1 << 30)):
        overrides = [f"policy.path={out / 'qwen3-wide'}", "policy.mtp.enabled=false", f"learner.device={device}",
                     f"learner.batch_groups={scale['groups']}", "learner.group_size=8", f"learner.logits_chunk_tokens={chunk}"]  # fmt: skip
        if device == "cuda":
            overrides.append("policy.dtype=bfloat16")
        run = load_config("quickstart", overrides)
        trainer = RLLearner.from_config(run)
        time_steps(trainer, run, options, device, results, f"learner_wide_vocab_{name}")
        del trainer


def time_steps(trainer, run, options, device: str, results: dict, prefix: str) -> None:
    """`prefix`_samples_per_s over two synthetic batches after a warm-up one, and on CUDA `prefix`_peak_memory_gib."""
    from asyncrl.bench.learner import synthetic_batch

    batches = [synthetic_batch(run, options, trainer.model.config.vocab_size, seed) for seed in range(3)]
    trainer.train_step(batches[0])  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in batches[1:]:
        trainer.train_step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    say(results, f"{prefix}_samples_per_s", round(sum(len(b.samples) for b in batches[1:]) / (time.perf_counter() - start), 1))
    if device == "cuda":
        say(results, f"{prefix}_peak_memory_gib", round(torch.cuda.max_memory_allocated() / 2**30, 2))


def push_check(trainer, device: str, results: dict) -> None:
    """The learner's push (`state_dict_for_push`: every tensor copied to the CPU) against its limit, the
    bytes over the measured copy bandwidth (device to host on a GPU, main memory on a CPU)."""
    from asyncrl.bench.learner import copy_bandwidth

    times = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        weights = trainer.state_dict_for_push()
        times.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    if device == "cuda":
        probe, best = torch.ones(nbytes // 4 + 1, device="cuda"), float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            probe.to("cpu")
            best = min(best, time.perf_counter() - start)
        bandwidth = probe.numel() * 4 / best
    else:
        bandwidth = copy_bandwidth(nbytes)
    push_s = sorted(times)[1]
    say(results, "learner_push_mb", round(nbytes / 1e6, 1))
    say(results, "learner_push_s", round(push_s, 4))
    say(results, "learner_push_over_copy_limit", round(push_s / (nbytes / bandwidth), 2))


def fingerprint(buffer: torch.Tensor) -> int:
    """A bucket's bytes in one number that a changed or moved byte changes (a weighted sum, exact in int64)."""
    weights = torch.arange(buffer.numel(), device=buffer.device) % 251 + 1
    return int((buffer.long() * weights).sum())


def broadcast_receiver(address, world: int, backend: str, layout, rounds: int, answers) -> None:
    """The engine's side of `broadcast_check`, in a process of its own: receive `rounds` pushes, answer
    each bucket's fingerprint."""
    import os

    from asyncrl.weight_transfer import WeightGroup

    if backend == "nccl":
        os.environ["NCCL_HOSTID"] = "asyncrl-smoke-engine"
        torch.cuda.set_device(torch.cuda.device_count() - 1)
    group = WeightGroup(address, 1, world, backend, generation=1)
    for _ in range(rounds):
        received = group.receive(layout)
        answers.put([fingerprint(buffer) for buffer in _buckets(layout, received)])


def _buckets(layout, tensors: dict) -> list[torch.Tensor]:
    from asyncrl.weight_transfer import pack

    device = next(iter(tensors.values())).device
    return [pack(layout, bucket, tensors, device) for bucket in range(len(layout.bucket_sizes))]


def broadcast_check(trainer, device: str, results: dict) -> None:
    """The broadcast push (`rollout.weight_transport=broadcast`): the learner's weights to an engine's
    process over NCCL (gloo on a CPU), bit for bit, and how long it takes. On one GPU both processes use
    it, which NCCL allows only through its network transport (a host id of their own each): the check
    then proves the code path, and its speed says little of two GPUs' NVLink."""
    import os

    import torch.multiprocessing as mp

    from asyncrl.weight_transfer import Layout, WeightGroup, host_store

    backend, rounds = ("nccl" if device == "cuda" else "gloo"), 3
    tensors = trainer.push_tensors()
    layout = Layout.plan(tensors.items())
    store, address = host_store(2)
    context = mp.get_context("spawn")
    answers = context.Queue()
    receiver = context.Process(target=broadcast_receiver, args=(address, 2, backend, layout, rounds, answers))
    receiver.start()
    if backend == "nccl":
        os.environ["NCCL_HOSTID"] = "asyncrl-smoke-learner"
    times = []
    try:
        group = WeightGroup(address, 0, 2, backend, generation=1, store=store)
        for _ in range(rounds):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            group.send(layout, tensors)
            times.append(time.perf_counter() - start)
        expected = [fingerprint(buffer) for buffer in _buckets(layout, tensors)]
        same = all(answers.get(timeout=300) == expected for _ in range(rounds))
        receiver.join(timeout=60)
        group.close()
    except Exception as error:  # recorded, and the checks after this one still run
        say(results, "broadcast_error", repr(error))
        return
    finally:
        if receiver.is_alive():
            receiver.kill()
    send_s = sorted(times)[1]
    say(results, "broadcast_backend", backend)
    say(results, "broadcast_buckets", len(layout.bucket_sizes))
    say(results, "broadcast_bit_exact", same)
    say(results, "broadcast_s", round(send_s, 4))
    say(results, "broadcast_gb_per_s", round(layout.total_bytes / send_s / 1e9, 2))


def run_check(device: str, results: dict, out: Path, seconds: float) -> None:
    if seconds <= 0:
        say(results, "asyncrl_run", "skipped: --run-seconds 0")
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        say(results, "asyncrl_run", "skipped: ray is not installed here")
        return
    from asyncrl.cli import main

    overrides = [f"runs_dir={out / 'runs'}", "name=gpu-smoke", f"learner.device={device}", f"rollout.device={device}",
                 f"loop.wall_budget_s={seconds}", "sft.time_budget_s=120", "logging.wandb=disabled", "logging.progress=false"]  # fmt: skip
    if device == "cuda" and torch.cuda.device_count() < 2:  # the learner and the engine share the one GPU
        overrides += ["learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"]
    faulthandler.dump_traceback_later(seconds + 300)  # a run that never returns shows where it waits
    code = main(["run", "quickstart", *overrides])
    faulthandler.cancel_dump_traceback_later()
    say(results, "asyncrl_run_exit", code)
    if code != 0:
        return
    summary = json.loads((out / "runs" / "gpu-smoke" / "summary.json").read_text())
    say(results, "asyncrl_run_heldout", [summary.get("eval_before"), summary.get("eval_after")])
    say(results, "asyncrl_run_version", summary.get("version"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-smoke"))
    parser.add_argument("--size", type=int, default=1024, help="hidden size of the generated models for the throughput figures")
    parser.add_argument("--run-seconds", type=float, default=120.0, help="wall budget of the asyncrl run check (0 skips it)")
    parser.add_argument("--quick", action="store_true", help="small throughput workloads: only exercises the code")
    args = parser.parse_args()
    from asyncrl.learner.consistency import LogprobGapWarning

    warnings.simplefilter("ignore", LogprobGapWarning)  # the synthetic batches' rollout log-probs are made up
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[gpu-smoke] no CUDA device here (--device cpu runs the same checks on the CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    print(f"[gpu-smoke] {results}", flush=True)
    scale = SCALE["quick" if args.quick else "full"]
    for check in (
        lambda: engine_checks(args.device, results, args.size, scale),
        lambda: learner_checks(args.device, results, args.size, scale),
        lambda: wide_vocabulary_check(args.device, results, out, scale),
    ):
        check()
        (out / "gpu_smoke.json").write_text(json.dumps(results, indent=2) + "\n")
    run_check(args.device, results, out, args.run_seconds)
    (out / "gpu_smoke.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
