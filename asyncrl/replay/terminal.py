"""The terminal view of `asyncrl replay score`: per sample a header, the tokens as coloured text, a
per-turn table and the tokens that drifted most.

The text is coloured by the first checkpoint's ratio: environment and prompt tokens dim, kept tokens
green (|log r| < 0.05), yellow (< 0.2) or red, tokens an objective masks reversed (blue below the
band, red above), so a 100-token rollout reads as one paragraph and its trouble spots stand out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .records import RolloutScore, TokenScore

TOP_TOKENS = 5
"""Most-drifted tokens listed per sample."""


def render(scores: Sequence[RolloutScore], console: Console, *, shown: int = 10) -> None:
    """Print the first `shown` samples, then a line saying how many more there are."""
    for score in scores[:shown]:
        render_one(score, console)
    if len(scores) > shown:
        console.print(f"[dim]... {len(scores) - shown} more samples (--show N prints more; --json and --html hold them all)[/]")


def render_one(score: RolloutScore, console: Console) -> None:
    labels = [c["label"] for c in score.checkpoints]
    reward = "-" if score.reward is None else f"{score.reward:g}"
    advantage = "-" if score.advantage is None else f"{score.advantage:+.3f}"
    console.rule(Text(f"rollout {score.rollout_id}" + (f" fork {score.branch}" if score.branch else ""), style="bold"))
    console.print(
        f"task {score.task or '-'}  status {score.status}  reward {reward}  advantage {advantage}"
        f"  account {score.account or '- (group incomplete)'}  sampled tokens {score.summary.get('sampled_tokens', 0)}",
        markup=False,
    )
    for label in labels:
        console.print(Text(f"  {label}: ", style="bold").append(_figures(score.summary, label), style=""))
    if kl := score.summary.get("kl"):
        console.print(Text("  KL (k1 on sampled tokens): " + "  ".join(f"{pair} {value:+.4f}" for pair, value in kl.items())))
    if labels:
        console.print(colored_text(score.tokens, labels[0]))
        console.print(_legend(labels[0]))
    console.print(_turn_table(score, labels))
    if top := _top_tokens(score, labels):
        console.print(top)


def _figures(summary: dict, label: str) -> str:
    mean, largest = summary.get("mean_abs_delta", {}).get(label), summary.get("max_abs_delta", {}).get(label)
    if mean is None:
        return "no sampled tokens"
    masked = summary.get("masked_fraction", {}).get(label, {})
    return f"mean |Δ log-p| {mean:.4f}  max {largest:.4f}  masked " + "  ".join(f"{o} {f:.1%}" for o, f in masked.items())


def colored_text(tokens: Sequence[TokenScore], label: str) -> Text:
    """The sample's tokens, coloured by their ratio under `label`."""
    text = Text()
    for token in tokens:
        shown = token.text.replace("\n", "⏎\n") if token.sampled else token.text
        text.append(shown, style=_style(token, label))
    return text


def _style(token: TokenScore, label: str) -> str:
    if not token.sampled or label not in token.ratios:
        return "dim"
    verdicts = set(token.decisions.get(label, {}).values())
    if "below" in verdicts:
        return "reverse bold blue"
    if "above" in verdicts:
        return "reverse bold red"
    drift = abs(math.log(token.ratios[label])) if token.ratios[label] > 0 else math.inf
    return "green" if drift < 0.05 else "yellow" if drift < 0.2 else "red"


def _legend(label: str) -> Text:
    return Text.assemble(
        (f"  colours: ratio under {label}: ", "dim"), ("|log r|<0.05", "green"), " ", ("<0.2", "yellow"), " ", ("more", "red"),
        " ", ("masked below", "reverse bold blue"), " ", ("masked above", "reverse bold red"), " ", ("not sampled", "dim"),
    )  # fmt: skip


def _turn_table(score: RolloutScore, labels: list[str]) -> Table:
    """One row per turn and checkpoint (narrow enough for 80 columns whatever the checkpoints)."""
    objectives = _objectives(score)
    table = _table("per turn", ["turn", "sampled", "tool calls", "checkpoint", "mean|Δ|", "max|Δ|", *(f"masked {o}" for o in objectives)])
    for turn in score.turns:
        for n, label in enumerate(labels):
            masked = turn.masked_fraction.get(label, {})
            head = [str(turn.index), str(turn.sampled_tokens), str(turn.tool_calls)] if n == 0 else ["", "", ""]
            table.add_row(*head, label, _number(turn.mean_abs_delta.get(label)), _number(turn.max_abs_delta.get(label)),
                          *(f"{masked[o]:.0%}" if o in masked else "-" for o in objectives))  # fmt: skip
    return table


def _top_tokens(score: RolloutScore, labels: list[str]) -> Table | None:
    """The sampled tokens whose re-scored log-prob moved most from the rollout's, one row per checkpoint."""
    sampled = [t for t in score.tokens if t.sampled and t.rollout_logprob is not None and t.logprobs]
    if not sampled:
        return None
    drift = {t.position: max(abs(v - t.rollout_logprob) for v in t.logprobs.values()) for t in sampled}  # type: ignore[operator]
    objectives = _objectives(score)
    title = f"tokens that drifted most (of {len(sampled)} sampled)"
    kv = any(t.kv_version is not None for t in sampled)  # a KV column only where the engine recorded KV versions
    table = _table(
        title, ["pos", "turn", "token", "ver", "stale", *(["kv", "kv stale"] if kv else []), "rollout", "ckpt", "lp", "ratio", *objectives]
    )
    for t in sorted(sampled, key=lambda t: -drift[t.position])[:TOP_TOKENS]:
        for n, label in enumerate(labels):
            head = [str(t.position), str(t.turn), repr(t.text), str(t.version), str(t.staleness)]
            head += [str(t.kv_version), str(t.kv_staleness)] if kv else []
            head.append(f"{t.rollout_logprob:.3f}")
            decisions = t.decisions.get(label, {})
            table.add_row(*(head if n == 0 else [""] * len(head)), label, _number(t.logprobs.get(label), 3),
                          _number(t.ratios.get(label)), *(decisions.get(o, "-") for o in objectives))  # fmt: skip
    return table


def _objectives(score: RolloutScore) -> list[str]:
    found: dict[str, None] = {}
    for token in score.tokens:
        for decisions in token.decisions.values():
            found.update(dict.fromkeys(decisions))
        if found:
            break
    return list(found)


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in columns:
        table.add_column(
            column.replace("double_sided_is", "IS").replace("icepop_grpo", "IcePop"), justify="left" if column == "token" else "right"
        )
    return table


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
