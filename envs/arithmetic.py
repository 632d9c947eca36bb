"""The built-in reasoning task: integer addition and subtraction, bare or as a short word problem.

Problems are generated on the fly from a seed. The problem space is split once and for all by a hash
of the canonical problem (`a+b` or `a-b`, whatever the phrasing), so a held-out problem never
appears in training, not even reworded, and every process agrees on the split without sharing
state. The answer the model is taught is the bare number: the policy is character-level, so every
extra character costs a decoding step.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from asyncrl.configs.schema import ArithmeticTaskConfig

from .heldout import distinct_draws

if TYPE_CHECKING:
    from .tool_demos import ToolProblem

Op = Literal["+", "-"]

# Short on purpose: a word problem must not cost the char-level model many more tokens than `a+b`.
WORD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "Tom has {a} coins and gets {b} more. Total?",
        "{a} cats and {b} dogs. How many pets?",
        "Sum of {a} and {b}?",
        "Add {a} to {b}.",
    ),
    "-": (
        "Ann had {a} pens and gave away {b}. Left?",
        "{a} birds, {b} fly off. How many stay?",
        "What is {a} minus {b}?",
        "Take {b} from {a}.",
    ),
}
_ANSWER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: Op
    template: int | None = None
    """Index into WORD_TEMPLATES[op]; None is the bare expression `a+b`."""

    @property
    def canonical(self) -> str:
        """The problem without its phrasing; the held-out split is decided on this."""
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def prompt(self) -> str:
        if self.template is None:
            return self.canonical
        return WORD_TEMPLATES[self.op][self.template].format(a=self.a, b=self.b)

    def messages(self) -> list[dict]:
        """The chat prompt (one user turn)."""
        return [{"role": "user", "content": self.prompt}]

    def demonstration(self) -> list[dict]:
        """The prompt followed by the answer the model is taught: the bare number."""
        return [*self.messages(), {"role": "assistant", "content": str(self.answer)}]


def is_heldout(canonical: str, fraction: float) -> bool:
    """Deterministic membership of the held-out split (a hash, not Python's salted `hash`)."""
    digest = hashlib.blake2b(canonical.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def verify(completion_text: str, problem: Problem | ToolProblem) -> bool:
    """Exact integer match of the whole completion (surrounding whitespace and EOS stripped)."""
    from asyncrl.policy.tokenizer import EOS

    text = completion_text.strip()
    if text.endswith(EOS):
        text = text[: -len(EOS)].strip()
    return _ANSWER.fullmatch(text) is not None and int(text) == problem.answer


class ArithmeticTask:
    """Samples training or held-out problems; each split is closed under rephrasing."""

    def __init__(self, config: ArithmeticTaskConfig) -> None:
        self.config = config

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.config.min_digits, self.config.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _draw(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        op: Op = "-" if rng.random() < self.config.subtraction_fraction else "+"
        if op == "-" and a < b:
            a, b = b, a  # answers stay non-negative, so no sign to learn
        template = None
        if rng.random() < self.config.word_problem_fraction:
            template = rng.randrange(len(WORD_TEMPLATES[op]))
        return Problem(a, b, op, template)

    def sample(self, rng: random.Random, heldout: bool = False) -> Problem:
        """One problem from the training split (default) or the held-out split, by rejection."""
        for _ in range(100_000):
            problem = self._draw(rng)
            if is_heldout(problem.canonical, self.config.heldout_fraction) == heldout:
                return problem
        raise RuntimeError("the problem space is too small for this held-out fraction")

    def heldout_set(self, num_problems: int, seed: int) -> list[Problem]:
        """A fixed evaluation set of distinct problems (`envs/heldout.py`): drawing with replacement
        repeats the few held-out one-digit problems ~5 times each in 500."""
        return distinct_draws(
            lambda rng: self.sample(rng, heldout=True), lambda p: p.canonical, num_problems, seed,
            too_few=lambda found: ValueError(
                f"the held-out split has too few distinct problems for {num_problems} "
                f"(found {found}): lower eval.num_problems or widen the operand digits"
            ),
        )  # fmt: skip
