"""`asyncrl replay score RUN`: re-score recorded tokens under checkpoints (ratios, objective decisions, drift).

    asyncrl replay score runs/quickstart --limit 20                       # nearest + final checkpoints
    asyncrl replay score runs/quickstart --rollout 3f2a... --checkpoint start 12 final --json out.jsonl
    asyncrl replay score runs/quickstart --step 40 --html step40.html

Which checkpoints (`--checkpoint`, any number): a version (`12` or `v12`), `start` (the policy RL
began from), `final`, `nearest` (each token under the kept checkpoint nearest the version that
sampled it), or a checkpoint directory. The default is `nearest final`. Every checkpoint is checked
against the run's policy (architecture, the shapes that matter, the tokenizer's vocabulary) before
anything is scored, and loaded once. The run is only read (`RunView`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .cli import add_selection_arguments

if TYPE_CHECKING:
    from .rescore import Series
    from .run import CheckpointRef, RunView

ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
    "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "tie_word_embeddings",
)  # fmt: skip
"""config.json keys a checkpoint must share with the run's policy for its log-probs to mean the same thing."""
DEFAULT_SHOWN = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection_arguments(parser, limit_help="at most N rollouts (the first recorded)")
    parser.add_argument(
        "--checkpoint", nargs="+", action="extend", metavar="CKPT",
        help="version (12 or v12), start, final, nearest, or a checkpoint directory (default: nearest final)",
    )  # fmt: skip
    parser.add_argument(
        "--objective", nargs="+", action="extend", choices=("double_sided_is", "icepop_grpo"),
        help="objectives whose decisions to report (default: both)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per scored sample")
    parser.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    parser.add_argument(
        "--show", type=int, default=DEFAULT_SHOWN, metavar="N", help=f"rollouts the terminal view shows (default {DEFAULT_SHOWN})"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no per-rollout view; only the files and a summary line")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .rescore import OBJECTIVES, needed_checkpoints, rescore
    from .run import ReplayError, RunView, Selection
    from .terminal import render

    if args.limit is not None and args.limit < 1:
        raise ReplayError(f"--limit must be at least 1, got {args.limit}")
    with RunView.open(args.run) as view:
        selection = Selection(
            rollout_id=args.rollout, step=args.step, task=args.task, status=args.status,
            reward_min=args.reward_min, reward_max=args.reward_max, limit=args.limit,
        )  # fmt: skip
        trajectories = view.select(selection)
        err = Console(stderr=True)
        if not trajectories:
            err.print(f"nothing in {view.path} matches that selection")
            return 1
        series = resolve_series(view, args.checkpoint)
        loader = PolicyLoader(view)
        for ref in needed_checkpoints(view, trajectories, series):
            loader.check(ref)  # every refusal before the first forward
        with _Progress(err, quiet=args.quiet) as advance:
            scores = rescore(
                view, trajectories, series, loader.scorer, loader.tokenizer,
                objectives=args.objective or OBJECTIVES, progress=advance,
            )  # fmt: skip
        if args.json:
            write_json_lines(scores, Path(args.json))
        if args.html:
            from .html import objective_bands, shown_objective, write_report  # imported only when asked for

            learner, title = view.config.learner, f"replay score: {view.path.name}"
            write_report(scores, Path(args.html), title=title, bands=objective_bands(learner), objective=shown_objective(learner))
        if not args.quiet:
            render(scores, Console(), shown=args.show)
        outputs = [f"{kind} {path}" for kind, path in (("JSON lines", args.json), ("HTML", args.html)) if path]
        print(f"scored {len(scores)} samples of {len(trajectories)} rollouts under {', '.join(s.label for s in series)}"
              + (f"; wrote {', '.join(outputs)}" if outputs else ""), file=sys.stderr)  # fmt: skip
    return 0


def write_json_lines(scores, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for score in scores:
            f.write(json.dumps(score.to_dict()) + "\n")
    return path


# -- checkpoints ----------------------------------------------------------------------------------


def resolve_series(view: RunView, words: list[str] | None) -> list[Series]:
    """The series `--checkpoint` names (default `nearest final`), each label once."""
    from .rescore import Series

    if not words:
        return [Series("nearest", None), Series("final", view.final_checkpoint())]
    found: dict[str, Series] = {}
    for word in words:
        series = _series(view, word)
        found.setdefault(series.label, series)
    return list(found.values())


def _series(view: RunView, word: str) -> Series:
    from .rescore import Series
    from .run import CheckpointRef, ReplayError

    if word == "nearest":
        return Series("nearest", None)
    if word in ("start", "final"):
        return Series(word, view.start() if word == "start" else view.final_checkpoint())
    if match := re.fullmatch(r"v?(\d+)", word):
        ref = view.checkpoint(int(match[1]))
        return Series(ref.label, ref)
    path = Path(word)
    if not path.is_dir():
        raise ReplayError(f"--checkpoint {word!r}: not a version (12, v12), start, final, nearest, or a checkpoint directory")
    resolved = path.resolve()
    for ref in view.checkpoints():
        if ref.path is not None and ref.path.resolve() == resolved:
            return Series(ref.label, ref)
    return Series(path.name, CheckpointRef(_provenance_version(path), path, path.name))


def _provenance_version(path: Path) -> int:
    """The learner version a checkpoint says it holds (asyncrl provenance in config.json), or -1."""
    try:
        return int(json.loads((path / "config.json").read_text()).get("asyncrl", {}).get("version", -1))
    except (OSError, ValueError, TypeError):
        return -1


class PolicyLoader:
    """Checks checkpoints against the run's policy and loads each one as a scorer, once."""

    def __init__(self, view: RunView) -> None:
        self.view = view
        self.config, self.tokenizer = self._run_policy()

    def _run_policy(self) -> tuple[dict, object]:
        from asyncrl.policy.tiny import tiny_model_config
        from asyncrl.policy.tokenizer import build_tokenizer

        path = self.view.config.policy.path
        if path is None:
            return tiny_model_config(self.view.config.policy.tiny).to_dict(), build_tokenizer()
        return self._read(Path(path), "the run's policy.path")

    def _read(self, path: Path, what: str) -> tuple[dict, object]:
        from transformers import AutoTokenizer

        from .run import ReplayError

        if not (path / "config.json").is_file():
            raise ReplayError(f"{what} {path} is not a checkpoint directory (no config.json)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as error:
            raise ReplayError(f"{what} {path} has no tokenizer transformers can load: {error}") from None
        return json.loads((path / "config.json").read_text()), tokenizer

    def check(self, ref: CheckpointRef) -> None:
        """Refuse a checkpoint of another architecture or tokenizer, naming every mismatch."""
        from .run import ReplayError

        if ref.path is None:
            return  # the run's own starting policy, built from its config
        config, tokenizer = self._read(ref.path, f"checkpoint {ref.label}")
        problems = [
            f"{key} {config.get(key)!r} (the run's: {self.config.get(key)!r})"
            for key in ARCHITECTURE_KEYS
            if config.get(key) != self.config.get(key) and (key in config or key in self.config)
        ]
        problems += _vocabulary_mismatch(tokenizer.get_vocab(), self.tokenizer.get_vocab())  # type: ignore[attr-defined]
        if problems:
            raise ReplayError(f"checkpoint {ref.label} ({ref.path}) does not fit the run's policy: {'; '.join(problems)}")

    def scorer(self, ref: CheckpointRef):
        from asyncrl.policy.checkpoint import build_policy, load_policy
        from asyncrl.rollout.scoring import NativeScorer

        if ref.path is None:
            return NativeScorer(build_policy(self.view.config.policy, self.view.config.seed)[0])
        return NativeScorer(load_policy(ref.path)[0])


def _vocabulary_mismatch(theirs: dict[str, int], ours: dict[str, int]) -> list[str]:
    if theirs == ours:
        return []
    problems = [f"tokenizer vocabulary of {len(theirs)} tokens (the run's: {len(ours)})"] if len(theirs) != len(ours) else []
    by_id = {i: t for t, i in ours.items()}
    differing = sorted((i, t, by_id.get(i)) for t, i in theirs.items() if by_id.get(i) != t)
    if differing:
        shown = ", ".join(f"id {i} is {t!r} (the run's {o!r})" for i, t, o in differing[:3])
        problems.append(f"tokenizer maps {len(differing)} ids to other tokens: {shown}")
    return problems or ["tokenizer vocabulary differs"]


class _Progress:
    """A rich progress bar on stderr while scoring (nothing with --quiet); yields the advance callback."""

    def __init__(self, console, *, quiet: bool) -> None:
        self.console, self.quiet, self.bar, self.task = console, quiet, None, None

    def __enter__(self):
        if self.quiet:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("re-scoring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=True
        )
        self.bar.start()
        self.task = self.bar.add_task("score", total=None)
        return self.advance

    def advance(self, done: int, total: int) -> None:
        assert self.bar is not None and self.task is not None
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
