"""reasoning-gym tasks (`env: reasoning_gym`): one procedurally generated problem per episode, scored by its generator.

The `reasoning-gym` package holds ~100 generators, each with its own verifier. An item is generated
from the generator's seed plus an index (`dataset[index]`), so `sample_task` draws only the index
with its `rng`. The held-out split is a stable hash of the question's text (`heldout_fraction` of
the question space), not a range of seeds: a small generator repeats the same question under many
seeds, and a seed split would then evaluate on questions seen in training. Train and held-out items
are therefore disjoint in content, in every process, without shared state.

The reward is the generator's own `score_answer` (in [0, 1], partial credit where the generator
gives it); `metrics["correct"]`, what held-out evaluation counts, is a score of exactly 1. A reply
the verifier cannot read (or that makes it raise) scores 0 and sets `metrics["unparseable"]`.

The embedded policy's tokenizer is printable ASCII plus newline and drops anything else. With
`ascii_only` (the default), questions are transliterated (accents dropped, tabs to spaces), and an
item whose question still is not ASCII, or whose answer is not ASCII (the policy could never write
it), is skipped and redrawn; a generator whose items are mostly skipped is refused at start-up.
"""

from __future__ import annotations

import hashlib
import math
import random
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from asyncrl.configs.context import EnvContext

from .base import Demonstration, EpisodeResult, Split
from .heldout import distinct_draws

PROBE_ITEMS = 64
"""Items generated at start-up to check that the generator yields usable (ASCII, short enough) questions."""
MAX_DRAWS = 1000
"""Draws before `sample_task` gives up finding an item of the requested split."""
_PRINTABLE = {"\n", *map(chr, range(32, 127))}


class ReasoningGymOptions(BaseModel):
    """The options of a `reasoning_gym` task (`tasks.mix.<name>.options`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    generator: str = Field(min_length=1)
    """The reasoning-gym dataset name (e.g. basic_arithmetic, leg_counting)."""
    generator_options: dict[str, Any] = {}
    """Fields of the generator's config dataclass (its own `seed` and `size` are set from the options below)."""
    seed: int | None = None
    """The generator's seed; None: the run's seed."""
    size: int = Field(100_000, ge=1)
    """Item indices drawn from: [0, size)."""
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of the question space (by hash of the question) held out for evaluation."""
    system_prompt: str | None = None
    """A system message before each question."""
    prompt_template: str = "{question}"
    """The user message; `{question}` is the generator's question."""
    answer_format: str | None = None
    """A hint appended to the user message on its own line (e.g. 'Answer with the number only.')."""
    answer_tag: str | None = None
    """Read the answer inside <tag>...</tag> (reasoning-gym's extract_answer); None: the whole reply, stripped."""
    max_question_chars: int | None = Field(None, ge=1)
    """Skip items whose question is longer (the tiny policy has 512 positions); None: no limit."""
    ascii_only: bool = True
    """Transliterate questions and skip items that stay non-ASCII (the embedded tokenizer's alphabet)."""
    max_tokens: int | None = Field(None, ge=1)
    """Answer budget; None: the run's loop.episode_max_tokens."""

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError("must contain {question}")
        try:
            template.format(question="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"is not a valid template with only {{question}}: {error}") from error
        return template


@dataclass(frozen=True)
class GymItem:
    """One generated problem: its index in the generator and the entry its verifier scores against."""

    index: int
    question: str
    """As shown to the policy (transliterated when `ascii_only`)."""
    entry: dict[str, Any] = field(compare=False, repr=False)
    """The generator's item (question, answer, metadata), untouched, for `score_answer`."""

    @property
    def answer(self) -> str:
        return str(self.entry["answer"])


class GeneratorError(ValueError):
    """The generator is unknown, its options are wrong, or its items cannot be used."""


class ReasoningGymEnv:
    name = "reasoning_gym"

    def __init__(self, options: ReasoningGymOptions, *, seed: int = 0, max_tokens: int = 16, temperature: float = 1.0) -> None:
        self.options = options
        self.max_tokens = options.max_tokens or max_tokens
        self.temperature = temperature
        self.dataset = _create(options, options.seed if options.seed is not None else seed)
        self._probe()

    @classmethod
    def from_config(cls, context: EnvContext, **options) -> ReasoningGymEnv:
        """Options validated (errors name the key); the run's seed, answer budget and temperature."""
        try:
            parsed = ReasoningGymOptions(**options)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in error.errors())
            raise GeneratorError(f"reasoning_gym options: {problems}") from None
        # The learner scores tokens at rollout.sampling.temperature; episodes must sample at the same one.
        return cls(parsed, seed=context.seed, max_tokens=context.episode_max_tokens, temperature=context.sampling.temperature)

    def item(self, index: int) -> GymItem | None:
        """Item `index`, or None when it cannot be shown to the policy (not ASCII, too long)."""
        entry = self.dataset[index]
        question = str(entry["question"])
        if self.options.ascii_only:
            question = _transliterate(question)
            if not _printable(question) or not _printable(str(entry["answer"])):
                return None
        if self.options.max_question_chars is not None and len(question) > self.options.max_question_chars:
            return None
        return GymItem(index, question, entry)

    def split_of(self, item: GymItem) -> Split:
        digest = hashlib.blake2b(item.question.encode(), digest_size=8).digest()
        return "eval" if int.from_bytes(digest, "big") / 2**64 < self.options.heldout_fraction else "train"

    def sample_task(self, rng: random.Random, split: Split = "train") -> GymItem:
        for _ in range(MAX_DRAWS):
            item = self.item(rng.randrange(self.options.size))
            if item is not None and self.split_of(item) == split:
                return item
        raise GeneratorError(f"generator {self.options.generator!r}: no {split} item in {MAX_DRAWS} draws (see heldout_fraction, size)")

    def heldout_tasks(self, num_problems: int, seed: int) -> list[GymItem]:
        """Distinct held-out questions (a small generator would repeat some, weighing them several times)."""
        return distinct_draws(
            lambda rng: self.sample_task(rng, "eval"), lambda item: item.question, num_problems, seed,
            too_few=lambda found: GeneratorError(
                f"generator {self.options.generator!r}: the held-out split has {found} distinct questions, fewer than "
                f"{num_problems}; lower eval_problems, raise heldout_fraction or widen generator_options"
            ),
        )  # fmt: skip

    def messages(self, item: GymItem) -> list[dict]:
        prompt = self.options.prompt_template.format(question=item.question)
        if self.options.answer_format:
            prompt += "\n" + self.options.answer_format
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A training-split question and the generator's answer (in the answer tag when one is configured)."""
        item = self.sample_task(rng, "train")
        tag = self.options.answer_tag
        answer = f"<{tag}>{item.answer}</{tag}>" if tag else item.answer
        return Demonstration([*self.messages(item), {"role": "assistant", "content": answer}])

    def score(self, reply: str, item: GymItem) -> tuple[float, bool]:
        """(the generator's score in [0, 1], whether the reply was unreadable); never raises."""
        answer: str | None = reply.strip()
        if self.options.answer_tag:
            from reasoning_gym.utils import extract_answer

            answer = extract_answer(reply, tag_name=self.options.answer_tag)
        if not answer:
            return 0.0, True
        try:
            value = float(self.dataset.score_answer(answer, item.entry))
        except Exception:  # a verifier that chokes on garbage: the answer is wrong, not the episode
            return 0.0, True
        return (min(max(value, 0.0), 1.0), False) if math.isfinite(value) else (0.0, True)

    async def run_episode(self, task: GymItem, client) -> EpisodeResult:
        reply = await client.chat.completions.create(
            model="policy", messages=self.messages(task), max_tokens=self.max_tokens, temperature=self.temperature
        )
        choice = reply.choices[0]
        reward, unparseable = self.score(choice.message.content or "", task)
        return EpisodeResult(
            reward=reward,
            metrics={
                "correct": reward == 1.0, "unparseable": unparseable, "generator": self.options.generator,
                "finish_reason": choice.finish_reason, "completion_tokens": reply.usage.completion_tokens,
            },
        )  # fmt: skip

    def _probe(self) -> None:
        probed = min(PROBE_ITEMS, self.options.size)
        usable = sum(self.item(index) is not None for index in range(probed))
        if usable * 2 < probed:
            why = "not printable ASCII (the embedded tokenizer's alphabet; set ascii_only: false for a policy that reads Unicode)"
            if self.options.max_question_chars is not None:
                why += f" or longer than max_question_chars={self.options.max_question_chars}"
            raise GeneratorError(
                f"generator {self.options.generator!r}: {usable} of the first {probed} items are usable; the rest are {why}"
            )


def _create(options: ReasoningGymOptions, seed: int) -> Any:
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise GeneratorError(f"env reasoning_gym needs the reasoning-gym package: pip install 'asyncrl[data]' ({error})") from error

    if options.generator not in DATASETS:
        raise GeneratorError(f"generator: unknown reasoning-gym generator {options.generator!r}; available: {', '.join(sorted(DATASETS))}")
    reserved = {"seed", "size"} & set(options.generator_options)
    if reserved:
        raise GeneratorError(f"generator_options: {', '.join(sorted(reserved))} are set by the task's own seed/size options")
    try:
        return reasoning_gym.create_dataset(options.generator, **options.generator_options, seed=seed, size=options.size)
    except TypeError as error:  # an unknown field of the generator's config dataclass
        fields = ", ".join(f for f in DATASETS[options.generator][1].__dataclass_fields__ if f not in ("seed", "size"))
        raise GeneratorError(f"generator_options of {options.generator!r}: {error}; its fields: {fields}") from None
    except (AssertionError, ValueError) as error:  # the generator's own validate()
        raise GeneratorError(f"generator_options of {options.generator!r} rejected: {error or 'invalid values'}") from None


def _transliterate(text: str) -> str:
    """Accented letters to their base letters, tabs to spaces; characters without an ASCII form are kept (and then refused)."""
    decomposed = unicodedata.normalize("NFKD", text.replace("\t", " ").replace("\r\n", "\n"))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def _printable(text: str) -> bool:
    return all(c in _PRINTABLE for c in text)
