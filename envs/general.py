"""The built-in general task: a short instruction with verifiable constraints, scored by a reward plug-in.

An instruction asks for one or two given words under constraints of the kinds general instruction
following checks, kept tiny because the policy is character-level and every character is a decoding
step:

    Use cat sun. 3 words. Caps. No dog. End with !      ->  CAT SUN CAT!

- required words (always): each given word appears;
- casing (always): all caps, lowercase, or title case;
- length (optional): exactly N words;
- forbidden word (optional): a word named in the prompt must not appear;
- format (optional): the answer ends with a given mark.

Any answer meeting the constraints is right (`Instruction.check`); the SFT demonstrations show one of
them (`Instruction.answer`: the words in order, repeated to length). The reward comes from the
configured plug-in (`tasks.general.reward`, default the `constraints` rule: the share of constraints
met), while `correct`, which held-out evaluation counts, is always the rules' verdict (all met), so
evaluations stay comparable whatever reward trains the policy, a judge included. The held-out split
is fixed by a hash of the canonical instruction, as for arithmetic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import GeneralTaskConfig

from .arithmetic import is_heldout
from .base import Demonstration, EpisodeResult, Split
from .heldout import distinct_draws
from .rewards import Reward, RewardError, load_reward

VOCAB = (
    "cat", "dog", "sun", "sky", "red", "tree", "fish", "bird", "milk", "rain", "snow", "star", "moon",
    "king", "cake", "rose", "wind", "fire", "lake", "hill", "road", "door", "book", "ship", "gold",
    "salt", "corn", "wolf", "frog", "bell", "leaf", "owl",
)  # fmt: skip
Case = Literal["upper", "lower", "title"]
CASE_PHRASES: dict[str, str] = {"upper": "Caps.", "lower": "Lowercase.", "title": "Title case."}
ENDINGS = ("!", ".", "?")
_PUNCTUATION = ".,!?;:"


@dataclass(frozen=True)
class Instruction:
    words: tuple[str, ...]
    case: Case
    count: int | None = None
    """Exact number of words asked for; None: any."""
    banned: str | None = None
    ending: str | None = None

    @property
    def canonical(self) -> str:
        """The instruction's content; the held-out split is decided on this."""
        return f"{','.join(self.words)}|{self.case}|{self.count}|{self.banned}|{self.ending}"

    @property
    def prompt(self) -> str:
        parts = [f"Use {' '.join(self.words)}."]
        if self.count is not None:
            parts.append(f"{self.count} words.")
        parts.append(CASE_PHRASES[self.case])
        if self.banned is not None:
            parts.append(f"No {self.banned}.")
        if self.ending is not None:
            parts.append(f"End with {self.ending}")
        return " ".join(parts)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    @property
    def answer(self) -> str:
        """The answer the demonstrations teach: the words in order, cycled to length, cased, ended."""
        n = self.count or len(self.words)
        words = [_cased(self.words[i % len(self.words)], self.case) for i in range(n)]
        return " ".join(words) + (self.ending or "")

    def demonstration(self) -> list[dict]:
        return [*self.messages(), {"role": "assistant", "content": self.answer}]

    def check(self, completion_text: str) -> dict[str, bool]:
        """Each constraint of this instruction -> whether the answer meets it (all False for an empty answer)."""
        from asyncrl.policy.tokenizer import EOS

        text = completion_text.strip().removesuffix(EOS).strip()
        tokens = text.split()
        words = [t.strip(_PUNCTUATION) for t in tokens]
        names = ["words", "case"] + [
            n for n, v in (("count", self.count), ("banned", self.banned), ("ending", self.ending)) if v is not None
        ]
        if not any(words):
            return dict.fromkeys(names, False)
        lowered = [w.lower() for w in words]
        met = {"words": all(w in lowered for w in self.words), "case": _has_case(words, self.case)}
        if self.count is not None:
            met["count"] = len(tokens) == self.count
        if self.banned is not None:
            met["banned"] = self.banned not in lowered
        if self.ending is not None:
            met["ending"] = text.endswith(self.ending)
        return met


def _cased(word: str, case: Case) -> str:
    return word.upper() if case == "upper" else word.capitalize() if case == "title" else word.lower()


def _has_case(words: list[str], case: Case) -> bool:
    letters = [c for w in words for c in w if c.isalpha()]
    if not letters:
        return False
    if case == "title":
        return all(w[:1].isupper() and (w[1:].islower() or not w[1:].isalpha()) for w in words if w)
    return all(c.isupper() for c in letters) if case == "upper" else all(c.islower() for c in letters)


def sample_instruction(rng: random.Random, config: GeneralTaskConfig) -> Instruction:
    """One instruction from the whole space (both splits); optional constraints each with constraint_fraction."""
    chosen = rng.sample(VOCAB, rng.randint(1, min(2, config.max_words)))
    case: Case = rng.choice(("upper", "lower", "title"))
    p = config.constraint_fraction
    count = rng.randint(len(chosen), config.max_words) if rng.random() < p else None
    banned = rng.choice([w for w in VOCAB if w not in chosen]) if rng.random() < p else None
    ending = rng.choice(ENDINGS) if rng.random() < p else None
    return Instruction(tuple(chosen), case, count, banned, ending)


class GeneralTask:
    """Samples training or held-out instructions (the SFT demonstrations draw from here too)."""

    def __init__(self, config: GeneralTaskConfig | None = None) -> None:
        self.config = config or GeneralTaskConfig()

    def sample(self, rng: random.Random, heldout: bool = False) -> Instruction:
        for _ in range(100_000):
            instruction = sample_instruction(rng, self.config)
            if is_heldout(instruction.canonical, self.config.heldout_fraction) == heldout:
                return instruction
        raise RuntimeError("the instruction space is too small for this held-out fraction")

    def heldout_set(self, num_problems: int, seed: int) -> list[Instruction]:
        """Distinct held-out instructions, the same for the same seed in every process."""
        return distinct_draws(
            lambda rng: self.sample(rng, heldout=True), lambda i: i.canonical, num_problems, seed,
            too_few=lambda found: ValueError(f"the held-out split has too few distinct instructions for {num_problems} (found {found})"),
        )  # fmt: skip


class GeneralEnv:
    name = "general"

    def __init__(self, config: GeneralTaskConfig | None = None, reward: Reward | None = None, *, temperature: float = 1.0) -> None:
        self.config = config or GeneralTaskConfig()
        self.task = GeneralTask(self.config)
        self.reward = reward if reward is not None else load_reward(self.config.reward, self.config.reward_options)
        self.temperature = temperature

    @classmethod
    def from_config(cls, context: EnvContext, **options: Any) -> GeneralEnv:
        """`tasks.general` with `options` overriding its fields; its reward built with the run's `rewards` section."""
        task = GeneralTaskConfig(**{**context.tasks.general.model_dump(), **options})
        reward = load_reward(task.reward, task.reward_options, context)
        return cls(task, reward, temperature=context.sampling.temperature)

    def sample_task(self, rng: random.Random, split: Split = "train") -> Instruction:
        return self.task.sample(rng, heldout=split == "eval")

    def heldout_tasks(self, num_problems: int, seed: int) -> list[Instruction]:
        return self.task.heldout_set(num_problems, seed)

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A training-split instruction and an answer that meets its constraints."""
        return Demonstration(self.task.sample(rng).demonstration())

    async def run_episode(self, task: Instruction, client: Any) -> EpisodeResult:
        messages = task.messages()
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=self.config.max_tokens, temperature=self.temperature
        )
        choice = reply.choices[0]
        text = choice.message.content or ""
        scored = await self.reward.score(messages, text, task)  # RewardError -> env_crash (runner)
        if not math.isfinite(scored.reward):
            raise RewardError(f"reward {self.config.reward!r} gave {scored.reward!r}")
        met = task.check(text)
        return EpisodeResult(
            scored.reward,
            metrics={
                "correct": all(met.values()), "constraints_met": sum(met.values()) / len(met),
                "reward_details": scored.details, "finish_reason": choice.finish_reason,
                "completion_tokens": reply.usage.completion_tokens,
            },
        )  # fmt: skip
