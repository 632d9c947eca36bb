"""The SFT warm start: train the policy (and its MTP layer) from scratch on synthetic demonstrations.

The goal is a partly capable policy, not a solved task: RL needs prompts it sometimes gets right
and sometimes wrong, so training stops at the first held-out evaluation at or above
`sft.stop_at_accuracy`, or at `sft.time_budget_s`, or at `sft.max_steps`, whichever comes first.
Everything lands in `<runs_dir>/<name>/sft/`: the checkpoint (a Hugging Face directory),
`metrics.jsonl`, `curves.png`, the resolved config and, when enabled, an offline wandb run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.configs.loader import dump_config
from asyncrl.configs.schema import RunConfig
from asyncrl.policy.checkpoint import build_policy, save_policy
from asyncrl.policy.mtp import mtp_loss, policy_hidden_and_logits
from asyncrl.rollout import EmbeddedEngine
from asyncrl.runlog import MetricsLog, Panel, plot_panels

from .evaluate import engine_greedy_generate, evaluate_arithmetic
from .sft_data import Demo, DemoStream, collate, length_buckets

LOG_EVERY = 10
"""Optimizer steps between metrics records (evaluations are always recorded)."""


@dataclass
class SFTResult:
    checkpoint: Path
    accuracy: float
    """Held-out greedy accuracy of the saved checkpoint."""
    steps: int
    wall_s: float
    stop_reason: str
    """'accuracy', 'time_budget' or 'max_steps'."""


def next_token_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | None = None
) -> torch.Tensor:
    """Summed cross-entropy over the tokens the mask trains (`loss_mask[:, j]` = token j), divided
    by `num_tokens` (default: this batch's trained tokens, i.e. the token mean)."""
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
    )
    weights = loss_mask[:, 1:].reshape(-1)
    count = weights.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    return (per_token * weights).sum() / count


class _Reporter:
    """metrics.jsonl and an optional offline wandb run (`MetricsLog`), plus an optional rich progress bar."""

    def __init__(self, config: RunConfig, out_dir: Path) -> None:
        self.log = MetricsLog(config, out_dir, f"{config.name}-sft")
        self.records: list[dict] = []
        self.progress = None
        if config.logging.progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("SFT"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"), transient=False,
            )  # fmt: skip
            self.task = self.progress.add_task("sft", total=config.sft.max_steps, status="")
            self.progress.start()

    def record(self, metrics: dict) -> None:
        self.records.append(metrics)
        self.log.record(metrics)

    def advance(self, step: int, status: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.log.close()


def plot_curves(records: list[dict], path: Path) -> None:
    """Training loss (and MTP loss) and held-out accuracy against optimizer step."""
    loss = Panel("SFT loss", "loss", [("loss", "next-token loss"), ("mtp_loss", "MTP loss")], yscale="log")
    accuracy = Panel("held-out greedy accuracy", "accuracy", [("eval_accuracy", "held-out")], ylim=(0, 1), marker="o")
    plot_panels([r for r in records if "loss" in r or "eval_accuracy" in r], [loss, accuracy], path)


def train_step(config: RunConfig, model, mtp, demos: list[Demo], pad_token_id: int) -> tuple[float, float | None, int]:
    """Accumulate the gradients of one optimizer step over length-bucketed micro-batches.

    Returns the step's next-token loss, MTP loss (None without MTP) and token count. Both losses
    are token means over the whole step, so bucketing changes the cost and nothing else.
    """
    num_targets = float(sum(sum(d.loss_mask[1:]) for d in demos))
    depth, weight = config.policy.mtp.train_depth, config.policy.mtp.loss_weight
    loss_total, aux_total, tokens = 0.0, 0.0, 0
    for bucket in length_buckets(demos):
        batch = collate(bucket, pad_token_id)
        ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        hidden, logits = policy_hidden_and_logits(model, ids, attention)
        loss = next_token_loss(logits, ids, mask, num_targets)
        total = loss
        if mtp is not None:
            aux = mtp_loss(model, mtp, hidden, ids, attention, mask, depth, num_targets)
            total = total + weight * aux
            aux_total += aux.item()
        total.backward()
        loss_total += loss.item()
        tokens += int(attention.sum())
    return loss_total, (aux_total if mtp is not None else None), tokens


def run_sft(config: RunConfig) -> SFTResult:
    """Train, evaluate, stop by the SFT rules, save; see the module docstring for the outputs."""
    torch.set_num_threads(config.torch_threads)
    sft = config.sft
    out_dir = Path(config.runs_dir) / config.name / "sft"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(dump_config(config))

    model, tokenizer, mtp = build_policy(config.policy, config.seed)
    model.train()
    modules = [model] + ([mtp.train()] if mtp is not None else [])
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=sft.lr, weight_decay=sft.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, sft.warmup_steps)))
    stream = DemoStream(
        tokenizer, config.tasks.arithmetic, sft.tool_demo_fraction, seed=config.seed,
        general_demo_fraction=sft.general_demo_fraction, general_config=config.tasks.general,
    )  # fmt: skip
    # Evaluation samples the way rollouts will: through the embedded engine, fed the current weights.
    engine = EmbeddedEngine(model, config.rollout.model_copy(update={"torch_threads": config.torch_threads}))
    generate = engine_greedy_generate(engine)

    def evaluate() -> float:
        engine.update_weights(model.state_dict(), step)
        return evaluate_arithmetic(generate, tokenizer, config.tasks.arithmetic, config.eval).accuracy

    reporter = _Reporter(config, out_dir)
    start = time.perf_counter()
    window_tokens, window_train_s = 0, 0.0
    accuracy: float | None = None
    stop_reason, step = "max_steps", 0
    try:
        while step < sft.max_steps:
            step_start = time.perf_counter()
            loss, aux, tokens = train_step(config, model, mtp, stream.batch(sft.batch_size), tokenizer.pad_token_id)
            torch.nn.utils.clip_grad_norm_(params, sft.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            step += 1
            window_tokens += tokens
            window_train_s += time.perf_counter() - step_start

            accuracy_now = evaluate() if step % sft.eval_every == 0 else None
            elapsed = time.perf_counter() - start
            if step % LOG_EVERY == 0 or accuracy_now is not None:
                record = {
                    "step": step, "loss": loss, "mtp_loss": aux,
                    "lr": schedule.get_last_lr()[0], "tokens_per_s": window_tokens / window_train_s,
                    "elapsed_s": elapsed,
                }  # fmt: skip
                if accuracy_now is not None:
                    accuracy = record["eval_accuracy"] = accuracy_now
                    reporter.say(f"step {step}  {elapsed:6.1f}s  loss {loss:.3f}  held-out {accuracy_now:.1%}")
                reporter.record(record)
                window_tokens, window_train_s = 0, 0.0
            reporter.advance(step, f"loss {loss:.3f}  acc {'-' if accuracy is None else f'{accuracy:.1%}'}")

            if accuracy_now is not None and sft.stop_at_accuracy is not None and accuracy_now >= sft.stop_at_accuracy:
                stop_reason = "accuracy"
                break
            if elapsed >= sft.time_budget_s:
                stop_reason = "time_budget"
                break
        if accuracy is None or step % sft.eval_every != 0:
            accuracy = evaluate()  # the checkpoint's own accuracy, not an earlier step's
            reporter.record({"step": step, "eval_accuracy": accuracy, "elapsed_s": time.perf_counter() - start})
            reporter.say(f"final  step {step}  held-out {accuracy:.1%}")
    finally:
        reporter.close()
        engine.shutdown()

    wall = time.perf_counter() - start
    provenance = {"asyncrl": {"stage": "sft", "step": step, "heldout_accuracy": accuracy}}
    checkpoint = save_policy(out_dir / "checkpoint", model, tokenizer, mtp, extra_config=provenance)
    plot_curves(reporter.records, out_dir / "curves.png")
    return SFTResult(checkpoint, accuracy, step, wall, stop_reason)
