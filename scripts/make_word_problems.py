"""Generate the example dataset of docs/DATASETS.md: grade-school word problems with worked solutions.

    python scripts/make_word_problems.py            # rewrites configs/data/word_problems*.jsonl

Two files, the same problems: `word_problems.jsonl` holds RL rows (`question`, `answer`, `split`) for
`env: dataset`, and `word_problems_sft.jsonl` holds chat rows (`messages`: the question, then a worked
solution ending in "The answer is N.") for `sft.data`, training split only, so SFT never sees a
held-out problem. Everything follows from the seed: the same arguments rewrite both files byte for
byte (tests/test_word_problems.py checks the shipped ones).

Sized for the tiny char-level policy: printable ASCII only (one token per character), one or two
operations on small numbers, a handful of templates, and a question plus its solution far below the
policy's 512 positions. The held-out split is decided on the arithmetic alone (`5+3-2`, whatever the
story), so no held-out problem reaches training reworded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "configs" / "data"
RL_FILE, SFT_FILE = "word_problems.jsonl", "word_problems_sft.jsonl"
MAX_CHARS = 160
"""Longest question plus worked solution: a third of the tiny policy's 512 positions."""
MAX_SOLUTION_CHARS = 46
"""Longest worked solution, so it fits the preset's 48-token answer budget with the end-of-text token."""

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Zoe", "Max", "Eva")
ITEMS = ("apples", "coins", "marbles", "cookies", "stickers", "pencils", "cards", "shells")


@dataclass(frozen=True)
class Template:
    """One story shape: the numbers it needs, how to phrase it, and the arithmetic it stands for."""

    kind: str
    text: str
    """Format string over name, item, a, b (and c for two operations); the numbers appear in the order a, b, c."""
    draw: Callable[[random.Random], tuple[int, ...]]
    """Operands: small, and chosen so every intermediate and final result is a whole number >= 0."""
    ops: str
    """The operators applied left to right: "+", "-", "*", "/", or two of them."""


def _add(rng: random.Random) -> tuple[int, ...]:
    return rng.randint(2, 20), rng.randint(2, 20)


def _sub(rng: random.Random) -> tuple[int, ...]:
    a = rng.randint(5, 30)
    return a, rng.randint(1, a - 1)


def _mul(rng: random.Random) -> tuple[int, ...]:
    return rng.randint(2, 9), rng.randint(2, 9)


def _div(rng: random.Random) -> tuple[int, ...]:
    b, each = rng.randint(2, 9), rng.randint(2, 9)
    return b * each, b


def _add_sub(rng: random.Random) -> tuple[int, ...]:
    a, b = rng.randint(2, 15), rng.randint(2, 15)
    return a, b, rng.randint(1, a + b - 1)


def _mul_add(rng: random.Random) -> tuple[int, ...]:
    return rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 9)


TEMPLATES = (
    Template("add", "{name} has {a} {item} and gets {b} more. How many {item} now?", _add, "+"),
    Template("add", "{name} finds {a} {item}, then {b} more. How many in all?", _add, "+"),
    Template("add", "A book has {a} pages in part one and {b} in part two. How many pages?", _add, "+"),
    Template("sub", "{name} has {a} {item} and gives away {b}. How many are left?", _sub, "-"),
    Template("sub", "A book has {a} pages. {name} reads {b}. How many pages are left?", _sub, "-"),
    Template("mul", "{name} buys {a} bags with {b} {item} each. How many {item}?", _mul, "*"),
    Template("div", "{name} shares {a} {item} among {b} friends equally. How many each?", _div, "/"),
    Template("add_sub", "{name} has {a} {item}, gets {b} more, then loses {c}. How many now?", _add_sub, "+-"),
    Template("mul_add", "{name} has {a} boxes of {b} {item} and {c} loose ones. How many in all?", _mul_add, "*+"),
)  # fmt: skip


def _apply(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    quotient, remainder = divmod(left, right)
    assert remainder == 0, "division templates draw exact quotients"
    return quotient


def worked_solution(ops: str, operands: tuple[int, ...]) -> tuple[str, int]:
    """One equation per operation, each starting from the previous result, then the answer sentence."""
    value, steps = operands[0], []
    for op, right in zip(ops, operands[1:], strict=True):
        result = _apply(value, op, right)
        steps.append(f"{value} {op} {right} = {result}.")
        value = result
    return " ".join([*steps, f"The answer is {value}."]), value


def canonical(ops: str, operands: tuple[int, ...]) -> str:
    """The arithmetic without its story, e.g. `5+3-2`: the held-out split is decided on this."""
    return str(operands[0]) + "".join(f"{op}{right}" for op, right in zip(ops, operands[1:], strict=True))


def is_heldout(expression: str, fraction: float) -> bool:
    """Stable membership of the held-out split (blake2b, not Python's salted hash)."""
    digest = hashlib.blake2b(expression.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def generate(seed: int = 0, rows: int = 3000, heldout_fraction: float = 0.1) -> list[dict]:
    """Distinct problems (no question twice): question, answer, split and worked solution of each."""
    rng = random.Random(seed)
    problems: list[dict] = []
    seen: set[str] = set()
    while len(problems) < rows:
        template = rng.choice(TEMPLATES)
        operands = template.draw(rng)
        names = dict(zip("abc", operands, strict=False))
        question = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), **names)
        if question in seen:
            continue
        seen.add(question)
        solution, answer = worked_solution(template.ops, operands)
        if len(solution) > MAX_SOLUTION_CHARS or len(question) + len(solution) > MAX_CHARS:
            raise ValueError(f"a template outgrew the length bounds: {question!r} -> {solution!r}")
        split = "test" if is_heldout(canonical(template.ops, operands), heldout_fraction) else "train"
        problems.append({"question": question, "answer": str(answer), "split": split, "solution": solution})
    return problems


def rl_rows(problems: list[dict]) -> list[dict]:
    """Rows of `env: dataset`: the question, its answer for the math reward, the split column."""
    return [{"question": p["question"], "answer": p["answer"], "split": p["split"]} for p in problems]


def sft_rows(problems: list[dict]) -> list[dict]:
    """Chat rows of `sft.data`, training split only: the question and its worked solution."""
    return [
        {"messages": [{"role": "user", "content": p["question"]}, {"role": "assistant", "content": p["solution"]}]}
        for p in problems
        if p["split"] == "train"
    ]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=True, separators=(",", ":")) + "\n" for row in rows)


def write(out_dir: Path, seed: int = 0, rows: int = 3000, heldout_fraction: float = 0.1) -> tuple[Path, Path]:
    """Write both files under `out_dir`; returns their paths (RL rows, SFT rows)."""
    problems = generate(seed, rows, heldout_fraction)
    out_dir.mkdir(parents=True, exist_ok=True)
    rl_path, sft_path = out_dir / RL_FILE, out_dir / SFT_FILE
    # newline="\n": the same bytes on every platform, so the shipped files compare equal anywhere.
    rl_path.write_text(jsonl(rl_rows(problems)), encoding="ascii", newline="\n")
    sft_path.write_text(jsonl(sft_rows(problems)), encoding="ascii", newline="\n")
    return rl_path, sft_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=3000, help="distinct problems, both splits together")
    parser.add_argument("--heldout-fraction", type=float, default=0.1, help="share of the arithmetic reserved for the test split")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in write(args.out_dir, args.seed, args.rows, args.heldout_fraction):
        print(f"wrote {path} ({path.stat().st_size} bytes, {sum(1 for _ in path.open())} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
