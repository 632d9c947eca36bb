"""The SFT warm start: train the policy (and its MTP layer) from scratch on the environments' demonstrations.

The goal is a partly capable policy, not a solved task: RL needs prompts it sometimes gets right
and sometimes wrong, so training stops at the first held-out evaluation at or above
`sft.stop_at_accuracy`, or at `sft.time_budget_s`, or at `sft.max_steps`, whichever comes first.
Everything lands in `<runs_dir>/<name>/sft/`: the checkpoint (a Hugging Face directory),
`metrics.jsonl`, `curves.png`, the resolved config and, when enabled, an offline wandb run.

The demonstrations are the built-in environments' (`demonstration(rng)`, envs/base.py): the agentic
task's tool calls for `sft.tool_demo_fraction` of them, the general task's instructions for
`sft.general_demo_fraction`, arithmetic for the rest. With `sft.data.path`, chat rows from a file
make up `sft.data.fraction` of the conversations (learner/sft_data.py), rendered and normalised
exactly as the gateway renders a prompt (gateway/template.py, gateway/toolcalls.py): the rows'
text stays text. The held-out evaluation is the arithmetic environment's own episodes through an
in-process gateway over an embedded engine fed the current weights: the one evaluation path
(envs/evaluation.py) that RL runs report too; with a held-out split of the file, its loss
(`eval_loss`) is recorded at each evaluation as well.

With `sft.indexer_warmup`, the GLM-5 shape's DSA indexers are warmed up after the loop (whichever
rule stopped it) and before the final evaluation and the save: learner/indexer_warmup.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.configs.context import EnvContext
from asyncrl.configs.loader import dump_config
from asyncrl.configs.schema import RunConfig
from asyncrl.envs.base import OffersDemonstrations
from asyncrl.envs.evaluation import TaskEval, evaluate_env
from asyncrl.envs.registry import load_environment
from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.serving import episode_http_client, evaluation_gateway
from asyncrl.gateway.template import chat_template
from asyncrl.gateway.toolcalls import to_template_messages, to_template_tools
from asyncrl.learner.indexer_warmup import check_warmup, run_indexer_warmup
from asyncrl.learner.sft import evaluation_loss, sft_optimizer, train_step
from asyncrl.learner.sft_data import ChatRenderer, DemoStream, MixedStream
from asyncrl.learner.sft_rows import ChatRows
from asyncrl.policy.checkpoint import build_policy, save_policy
from asyncrl.policy.mtp import check_plain_head
from asyncrl.policy.validate import resolve_policy
from asyncrl.rollout import EmbeddedEngine
from asyncrl.runlog import MetricsLog, Panel, plot_panels
from asyncrl.sched.tasks import TaskMix

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


def demo_stream(
    config: RunConfig, tokenizer, seed: int | None = None, renderer: ChatRenderer | None = None, max_length: int | None = None
) -> DemoStream:
    """The configured mix of the built-in environments' demonstrations (seed: `config.seed` by default),
    rendered by `renderer` (default: the tokenizer's own chat template), none longer than `max_length` tokens."""
    sft, context = config.sft, EnvContext.of(config)
    shares = [
        (share, _demonstrator(name, {}, context))
        for share, name in ((sft.tool_demo_fraction, "agentic"), (sft.general_demo_fraction, "general"))
        if share  # an environment that contributes nothing is not built (the general one loads its reward)
    ]
    seed = config.seed if seed is None else seed
    return DemoStream(renderer or tokenizer, shares, _demonstrator(*base_task(config), context), seed=seed, max_length=max_length)


def gateway_form(messages, tools) -> tuple[list[dict], list[dict] | None]:
    """A chat row's messages and tools as the gateway hands them to the template (ValueError if malformed)."""
    return to_template_messages(messages), to_template_tools(tools)


def chat_rows(config: RunConfig, tokenizer) -> ChatRows:
    """The rows of `sft.data`, rendered as the gateway renders a prompt."""
    return ChatRows.load(config.sft.data, chat_template(tokenizer), gateway_form)


def training_stream(config: RunConfig, tokenizer, rows: ChatRows | None, max_length: int | None = None) -> DemoStream | MixedStream:
    """The demonstrations (none longer than `max_length`, the model's positions), or the file's rows mixed with
    them by `sft.data.fraction`."""
    renderer = chat_template(tokenizer)
    fraction = config.sft.data.fraction
    if rows is None:
        return demo_stream(config, tokenizer, renderer=renderer, max_length=max_length)
    demos = demo_stream(config, tokenizer, renderer=renderer, max_length=max_length) if fraction < 1.0 else None
    return MixedStream(rows.train, fraction, demos, config.seed)


def base_task(config: RunConfig) -> tuple[str, dict]:
    """The environment (reference, options) whose demonstrations fill the rest of the stream and whose held-out
    split SFT is scored on: the `tasks.mix` task named by `sft.task`, else the built-in reasoning task."""
    if config.sft.task is None:
        return "reasoning", {}
    spec = config.tasks.mix.get(config.sft.task)
    if spec is None:
        raise ValueError(f"sft.task {config.sft.task!r} is not a task of tasks.mix (its tasks: {', '.join(config.tasks.mix) or 'none'})")
    return spec.env, spec.options


def _demonstrator(name: str, options: dict, context: EnvContext) -> OffersDemonstrations:
    env = load_environment(name, options, context)
    if not isinstance(env, OffersDemonstrations):
        raise TypeError(f"environment {name!r} offers no demonstrations (no `demonstration(rng)`, see envs/base.py)")
    return env


class HeldOut:
    """Held-out greedy accuracy of the weights being trained: on the arithmetic environment's episodes, or
    with `sft.task` on that task's, exactly as the RL loop evaluates it (its sandboxes, its held-out count)."""

    def __init__(self, config: RunConfig, model, tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.engine = EmbeddedEngine(model, config.rollout.embedded().model_copy(update={"torch_threads": config.torch_threads}))
        self.sandboxes, self.num_problems = None, config.eval.num_problems
        self.last: TaskEval | None = None
        """The last evaluation, episode by episode counted (its statuses say why episodes failed)."""
        if config.sft.task is None:
            # Each answer gets the evaluation's budget, as the warm start has always been scored.
            context = EnvContext.of(config).model_copy(update={"episode_max_tokens": config.eval.max_tokens})
            self.env = load_environment(*base_task(config), context)
            return
        mix = TaskMix.from_config(config)
        asyncio.run(mix.check_sandboxes())  # a backend that cannot start is refused here, not found episode by episode
        task = next(task for task in mix.tasks if task.name == config.sft.task)
        self.env, self.sandboxes = task.env, task.sandboxes
        self.num_problems = config.eval.num_problems if task.eval_problems is None else task.eval_problems

    def accuracy(self, weights: dict, step: int) -> float:
        self.engine.update_weights(weights, step)
        return asyncio.run(self._evaluate())

    async def _evaluate(self) -> float:
        config = self.config
        served = evaluation_gateway(config, [LocalEngine(self.engine)], self.tokenizer)
        async with served as gateway, episode_http_client(config, gateway) as http:
            result = self.last = await evaluate_env(
                self.env, gateway, num_problems=self.num_problems, seed=config.eval.seed, sandboxes=self.sandboxes,
                timeout_s=config.loop.episode_timeout_s, http_client=http,
            )  # fmt: skip
        return result.accuracy

    def close(self) -> None:
        self.engine.shutdown()


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
    series = [("loss", "next-token loss"), ("mtp_loss", "MTP loss"), ("eval_loss", "held-out loss")]
    loss = Panel("SFT loss", "loss", series, yscale="log")
    accuracy = Panel("held-out greedy accuracy", "accuracy", [("eval_accuracy", "held-out")], ylim=(0, 1), marker="o")
    plot_panels([r for r in records if "loss" in r or "eval_accuracy" in r or "eval_loss" in r], [loss, accuracy], path)


def _report_rows(reporter: _Reporter, rows: ChatRows) -> None:
    """What `sft.data` gave: rows to train on, held out and skipped (by reason), said and recorded at step 0."""
    skipped = sum(rows.skipped.values())
    reasons = "".join(f", {count} {reason}" for reason, count in rows.skipped.most_common())
    reporter.say(f"sft.data: {len(rows.train)} rows to train on, {len(rows.heldout)} held out, {skipped} skipped{reasons}")
    by_reason = {f"data_skipped/{reason}": count for reason, count in rows.skipped.items()}
    reporter.record({"step": 0, "data_rows": len(rows.train), "data_heldout_rows": len(rows.heldout), "data_skipped": skipped, **by_reason})


def _record_warmup(reporter: _Reporter, step: int, start: float, metrics: dict) -> None:
    """A DSA warm-up record (learner/indexer_warmup.py) at the SFT step it follows; the first, every LOG_EVERY-th
    and the agreement are said too."""
    reporter.record({"step": step, **metrics, "elapsed_s": time.perf_counter() - start})
    if "indexer_overlap" in metrics:
        k, overlap, chance = metrics["indexer_overlap_k"], metrics["indexer_overlap"], metrics["indexer_overlap_chance"]
        reporter.say(f"DSA warm-up: indexer top-{k} vs attention's top-{k}: overlap {overlap:.1%} (chance {chance:.1%})")
    elif metrics["indexer_step"] == 1 or metrics["indexer_step"] % LOG_EVERY == 0:
        loss = f"  loss {metrics['sparse_loss']:.3f}" if "sparse_loss" in metrics else ""
        reporter.say(f"DSA warm-up {metrics['indexer_stage']} step {metrics['indexer_step']}  indexer KL {metrics['indexer_kl']:.4f}{loss}")


def give_back_memory() -> None:
    """Call once `run_sft` has returned: its model, optimizer and engine are garbage, and their pages go back
    to the OS before the RL engines size their KV caches by the machine's available memory
    (rollout.kv_cache_memory). glibc keeps freed heap otherwise (SmolLM2's warm start left ~8 GB held)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_sft(config: RunConfig) -> SFTResult:
    """Train, evaluate, stop by the SFT rules, save; see the module docstring for the outputs."""
    config = config.model_copy(update={"policy": resolve_policy(config.policy)})
    torch.set_num_threads(config.torch_threads)
    sft = config.sft
    out_dir = Path(config.runs_dir) / config.name / "sft"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(dump_config(config))

    training = _Training.build(config)
    model, tokenizer, mtp = training.model, training.tokenizer, training.mtp
    data = sft.data
    rows = chat_rows(config, tokenizer) if data.path is not None else None
    stream = training_stream(config, tokenizer, rows, max_length=getattr(model.config, "max_position_embeddings", None))
    pack_length = data.max_length if data.packing else None
    heldout_rows = rows.heldout[: data.heldout_max_rows] if rows is not None else []
    heldout = HeldOut(config, model, tokenizer)
    evaluate = _Evaluation(heldout, model, heldout_rows, tokenizer.pad_token_id, pack_length)

    reporter = _Reporter(config, out_dir)
    if rows is not None:
        _report_rows(reporter, rows)
    start = time.perf_counter()
    try:
        step, accuracy, stop_reason = _train(config, training, stream, pack_length, evaluate, reporter, start)
        warmed = run_indexer_warmup(
            config, model, mtp, stream.batch, tokenizer.pad_token_id, pack_length, training.params, training.optimizer,
            lambda metrics: _record_warmup(reporter, step, start, metrics),
        )  # fmt: skip
        if warmed or accuracy is None or step % sft.eval_every != 0:
            scores = evaluate(step)  # the checkpoint's own accuracy, not an earlier step's
            accuracy = scores["eval_accuracy"]
            reporter.record({"step": step, **scores, "elapsed_s": time.perf_counter() - start})
            reporter.say(f"final  step {step}  held-out {accuracy:.1%}")
        _report_too_long(reporter, stream, model)
    finally:
        reporter.close()
        heldout.close()

    wall = time.perf_counter() - start
    provenance = {"asyncrl": {"stage": "sft", "step": step, "heldout_accuracy": accuracy}}
    if warmed:
        provenance["asyncrl"]["indexer_warmup"] = sft.indexer_warmup.model_dump()
    checkpoint = save_policy(out_dir / "checkpoint", model, tokenizer, mtp, extra_config=provenance)
    plot_curves(reporter.records, out_dir / "curves.png")
    return SFTResult(checkpoint, accuracy, step, wall, stop_reason)


@dataclass
class _Training:
    """The policy under SFT (and its MTP layer), and the optimizer and learning-rate schedule that move it."""

    model: Any
    tokenizer: Any
    mtp: Any
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR

    @classmethod
    def build(cls, config: RunConfig) -> _Training:
        """The policy `config.policy` names, in training mode, refused where SFT's losses or warm-up cannot train it."""
        sft = config.sft
        model, tokenizer, mtp = build_policy(config.policy, config.seed)
        check_plain_head(model.eval())  # the losses read the decoder's states through the head, as the RL learner does
        check_warmup(sft.indexer_warmup, model)
        model.train()
        modules = [model] + ([mtp.train()] if mtp is not None else [])
        params = [p for module in modules for p in module.parameters() if p.requires_grad]
        optimizer = sft_optimizer(sft, model, mtp, params)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, sft.warmup_steps)))
        return cls(model, tokenizer, mtp, params, optimizer, schedule)

    def step(self, config: RunConfig, batch, pack_length: int | None) -> tuple[float, float | None, int]:
        """One optimizer step on `batch`: (next-token loss, MTP loss, tokens trained)."""
        loss, aux, tokens = train_step(config, self.model, self.mtp, batch, self.tokenizer.pad_token_id, pack_length)
        torch.nn.utils.clip_grad_norm_(self.params, config.sft.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss, aux, tokens


@dataclass
class _Evaluation:
    """The held-out scores of the weights being trained: greedy accuracy and, with held-out rows of `sft.data`, their loss."""

    heldout: HeldOut
    model: Any
    rows: list
    pad_token_id: int
    pack_length: int | None

    def __call__(self, step: int) -> dict:
        scores = {"eval_accuracy": self.heldout.accuracy(self.model.state_dict(), step)}
        if self.rows:
            scores["eval_loss"] = evaluation_loss(self.model, self.rows, self.pad_token_id, self.pack_length)
        return scores


def _train(
    config: RunConfig, training: _Training, stream: DemoStream | MixedStream, pack_length: int | None, evaluate: _Evaluation,
    reporter: _Reporter, start: float,
) -> tuple[int, float | None, str]:  # fmt: skip
    """Optimizer steps until an SFT rule stops them: (steps taken, the last held-out accuracy, which rule stopped them)."""
    sft = config.sft
    window_tokens, window_train_s = 0, 0.0
    accuracy: float | None = None
    step = 0
    while step < sft.max_steps:
        step_start = time.perf_counter()
        loss, aux, tokens = training.step(config, stream.batch(sft.batch_size), pack_length)
        step += 1
        window_tokens += tokens
        window_train_s += time.perf_counter() - step_start

        scores = evaluate(step) if step % sft.eval_every == 0 else None
        accuracy_now = scores["eval_accuracy"] if scores is not None else None
        elapsed = time.perf_counter() - start
        if step % LOG_EVERY == 0 or scores is not None:
            record = {
                "step": step, "loss": loss, "mtp_loss": aux,
                "lr": training.schedule.get_last_lr()[0], "tokens_per_s": window_tokens / window_train_s,
                "elapsed_s": elapsed,
            }  # fmt: skip
            if scores is not None:
                record.update(scores)
                accuracy = accuracy_now
                held_loss = f"  held-out loss {scores['eval_loss']:.3f}" if "eval_loss" in scores else ""
                reporter.say(f"step {step}  {elapsed:6.1f}s  loss {loss:.3f}  held-out {accuracy_now:.1%}{held_loss}")
            reporter.record(record)
            window_tokens, window_train_s = 0, 0.0
        reporter.advance(step, f"loss {loss:.3f}  acc {'-' if accuracy is None else f'{accuracy:.1%}'}")

        if accuracy_now is not None and sft.stop_at_accuracy is not None and accuracy_now >= sft.stop_at_accuracy:
            return step, accuracy, "accuracy"
        if elapsed >= sft.time_budget_s:
            return step, accuracy, "time_budget"
    return step, accuracy, "max_steps"


def _report_too_long(reporter: _Reporter, stream: DemoStream | MixedStream, model) -> None:
    """Says how many demonstrations the stream left out for not fitting the model's positions, if any."""
    too_long = getattr(stream, "too_long", 0) or getattr(getattr(stream, "demos", None), "too_long", 0)
    if too_long:
        reporter.say(f"left out {too_long} demonstrations longer than the model's {model.config.max_position_embeddings} positions")
