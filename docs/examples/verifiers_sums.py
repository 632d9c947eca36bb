"""A verifiers environment as its users write one, trained by asyncrl (docs/DATASETS.md, verifiers).

Sums of two numbers of 1-3 digits, asked bare ("17+305"), with a rubric that rewards the exact
answer. Nothing in this file knows about asyncrl: it is a verifiers environment module, and
`environment: verifiers_sums` in a task's options loads it by `verifiers.load_environment`, the
way verifiers loads any installed environment. Its `eval_dataset` is asyncrl's held-out split.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def _sums(rng: random.Random, count: int, taken: set[str]) -> list[dict]:
    rows: list[dict] = []
    while len(rows) < count:
        a, b = (rng.randrange(10 ** rng.randint(1, 3)) for _ in range(2))
        question = f"{a}+{b}"
        if question not in taken:
            taken.add(question)
            rows.append({"question": question, "answer": str(a + b)})
    return rows


def exact_sum(completion, answer, **_) -> float:
    """1 when the reply is the sum, and nothing else."""
    return float(bool(completion) and (completion[-1]["content"] or "").strip() == answer)


def load_environment(train_rows: int = 20_000, eval_rows: int = 200, seed: int = 0) -> vf.Environment:
    rng, taken = random.Random(seed), set()
    held_out = _sums(rng, eval_rows, taken)  # drawn first, so training never sees a held-out sum
    train = _sums(rng, train_rows, taken)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(held_out), rubric=vf.Rubric(funcs=[exact_sum]))
