"""SFT conversations rendered for training: token IDs plus a loss mask that is 1 exactly on assistant tokens.

Two sources: the environments' demonstrations (their optional `demonstration(rng)`, see envs/base.py),
mixed by `DemoStream`, and chat rows from a file (`sft.data`: JSONL, Parquet or a `datasets`
directory, read and checked by `ChatRows.load`), mixed with them by `MixedStream`. Both are
rendered by `render_demos`.

"Assistant tokens" means what the model itself writes after the generation prompt: the answer, any
tool-call markup, and the EOS that ends the turn. The role header `<|assistant|>` is not one of
them (the harness appends it, as `add_generation_prompt` does), nor are system, user or tool
tokens. This is the same rule as the RL sample's loss mask, so SFT and RL train the same positions.

Text is text: rendering goes through a `ChatRenderer`. In a run that is the gateway's own
(gateway/template.py, handed in by asyncrl/jobs/sft.py, since a component does not import another), so a
message that spells `<|assistant|>` is eight plain tokens in SFT exactly as in an RL prompt.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch


@dataclass
class Demo:
    token_ids: list[int]
    loss_mask: list[int]
    """1 where token_ids[j] is a target the model is trained to produce."""


class ChatRenderer(Protocol):
    """Renders template-form messages to text and encodes that text (gateway/template.py's `TokenizerTemplate`)."""

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class TokenizerRenderer:
    """A tokenizer's own `apply_chat_template` and `encode`, with no escaping of marker text in content:
    for the built-in demonstrations, whose text the environments write."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def as_renderer(tokenizer_or_renderer) -> ChatRenderer:
    """A renderer as it is, a tokenizer wrapped in `TokenizerRenderer`."""
    if hasattr(tokenizer_or_renderer, "render") and hasattr(tokenizer_or_renderer, "encode"):
        return tokenizer_or_renderer
    return TokenizerRenderer(tokenizer_or_renderer)


class NotPrefixStable(ValueError):
    """The chat template renders an earlier turn differently once later turns follow (Qwen3 drops an old turn's
    thinking section), so one sequence cannot hold every assistant turn as the model wrote it."""


def render_demos(renderer, messages: Sequence[dict], tools: list[dict] | None = None) -> list[Demo]:
    """The conversation as one demonstration (`render_demo`), or, under a template that is not prefix-stable,
    one per assistant turn: the conversation up to that turn, rendered as the model saw it when it
    wrote it, trained on that turn alone (what each RL turn is too, where the gateway forks)."""
    try:
        return [render_demo(renderer, messages, tools)]
    except NotPrefixStable:
        chat = as_renderer(renderer)
        demos = []
        for index in [index for index, message in enumerate(messages) if message["role"] == "assistant"]:
            prompt = chat.render(messages[:index], tools, generation_prompt=True)
            full = chat.render(messages[: index + 1], tools, generation_prompt=False)
            if not full.startswith(prompt):
                raise NotPrefixStable("the chat template renders an assistant turn that does not extend its own prompt") from None
            demos.append(_encode(chat, [(prompt, 0), (full[len(prompt) :], 1)], full))
        return demos


def render_demo(renderer, messages: Sequence[dict], tools: list[dict] | None = None) -> Demo:
    """Tokenize a conversation with the chat template and mark the assistant-written spans.

    `renderer`: a `ChatRenderer` or a tokenizer. Each assistant span is the difference between the
    conversation rendered through that message and the conversation before it rendered with the
    generation prompt, so the mask comes from the template's own rendering. The pieces are encoded
    one by one; the result is checked against encoding the whole conversation at once, so a
    tokenizer that would merge tokens across a turn boundary is refused rather than mis-masked.
    """
    chat = as_renderer(renderer)

    def render(upto: int, generation_prompt: bool = False) -> str:
        return chat.render(messages[:upto], tools, generation_prompt=generation_prompt)

    spans: list[tuple[str, int]] = []
    done = ""
    for index, message in enumerate(messages):
        full = render(index + 1)
        if message["role"] == "assistant":
            prompt = render(index, generation_prompt=True)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise NotPrefixStable("chat template is not prefix-stable; cannot mark assistant tokens")
            spans += [(prompt[len(done) :], 0), (full[len(prompt) :], 1)]
        else:
            if not full.startswith(done):
                raise NotPrefixStable("chat template is not prefix-stable; cannot mark assistant tokens")
            spans.append((full[len(done) :], 0))
        done = full
    return _encode(chat, spans, done)


def _encode(chat: ChatRenderer, spans: list[tuple[str, int]], whole: str) -> Demo:
    """Encode (text, trained) pieces one by one; refused where that differs from encoding `whole` at once."""
    token_ids: list[int] = []
    loss_mask: list[int] = []
    for text, trained in spans:
        ids = chat.encode(text) if text else []
        token_ids += ids
        loss_mask += [trained] * len(ids)
    if token_ids != chat.encode(whole):
        raise ValueError("the tokenizer merges tokens across a turn boundary; cannot mark assistant tokens")
    return Demo(token_ids, loss_mask)


MAX_SKIPPED_IN_A_ROW = 1000
"""`DemoStream` gives up, with an error, after this many demonstrations in a row too long for the model."""


class DemoSource(Protocol):
    """Anything with an environment's `demonstration(rng)`: an object with `messages` and `tools`."""

    def demonstration(self, rng: random.Random) -> Any: ...


class DemoStream:
    """An endless, seeded mix of demonstration sources.

    `shares`: (share, source) pairs; each demonstration draws one uniform number and takes the first
    source whose cumulative share exceeds it, `rest` when none does. The sources draw from the same
    seeded generator, so a seed fixes the whole stream.
    """

    def __init__(
        self, renderer, shares: Sequence[tuple[float, DemoSource]], rest: DemoSource, seed: int, max_length: int | None = None
    ) -> None:
        """`max_length`: demonstrations longer than this many tokens are left out (the model's positions:
        one with learned position embeddings cannot take more), counted in `too_long`."""
        if sum(share for share, _ in shares) > 1.0 + 1e-9:
            raise ValueError("the demonstration shares must not exceed 1")
        self.renderer, self.shares, self.rest = as_renderer(renderer), list(shares), rest
        self.rng = random.Random(seed)
        self.max_length = max_length
        self.too_long = 0
        self.pending: deque[Demo] = deque()  # the other turns of a demonstration split by `render_demos`

    def next(self) -> Demo:
        for _ in range(MAX_SKIPPED_IN_A_ROW):
            demo = self._next_any()
            if self.max_length is None or len(demo.token_ids) <= self.max_length:
                return demo
            self.too_long += 1
        raise ValueError(
            f"{MAX_SKIPPED_IN_A_ROW} demonstrations in a row are longer than the model's {self.max_length} positions: "
            "the policy cannot be trained on these tasks (lower sft.tool_demo_fraction, or use a model with more positions)"
        )

    def _next_any(self) -> Demo:
        if self.pending:
            return self.pending.popleft()
        draw, bound, source = self.rng.random(), 0.0, self.rest
        for share, candidate in self.shares:
            bound += share
            if draw < bound:
                source = candidate
                break
        demonstration = source.demonstration(self.rng)
        self.pending.extend(render_demos(self.renderer, demonstration.messages, tools=demonstration.tools))
        return self.pending.popleft()

    def batch(self, size: int) -> list[Demo]:
        return [self.next() for _ in range(size)]


class MixedStream:
    """Rows from a file mixed with a demonstration stream: each conversation is the file's next row
    with probability `fraction` (one seeded draw, as the demonstrations' shares are drawn), else the
    next demonstration. The file's rows come in a fresh seeded order on every pass."""

    def __init__(self, rows: Sequence[Demo], fraction: float, demos: DemoStream | None, seed: int) -> None:
        if not rows:
            raise ValueError("no rows to mix")
        if fraction < 1.0 and demos is None:
            raise ValueError("a fraction below 1 needs a demonstration stream for the rest")
        self.rows, self.fraction, self.demos = list(rows), fraction, demos
        self.rng = random.Random(f"sft.data:{seed}")
        self.order: list[int] = []

    def next(self) -> Demo:
        if self.demos is not None and self.rng.random() >= self.fraction:
            return self.demos.next()
        if not self.order:
            self.order = list(range(len(self.rows)))
            self.rng.shuffle(self.order)
        return self.rows[self.order.pop()]

    def batch(self, size: int) -> list[Demo]:
        return [self.next() for _ in range(size)]


class Masked(Protocol):
    """What bucketing and collation read of a row: its tokens and which of them are trained
    (a demonstration here, a learner row in `batch.py`)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def loss_mask(self) -> list[int]: ...


T = TypeVar("T")


def length_buckets(demos: list[T], ratio: float = 1.5, length: Callable[[T], int] | None = None) -> list[list[T]]:
    """Demos sorted by length and cut wherever a demo is `ratio` times longer than its bucket's first.

    One padded batch of short arithmetic demos and long tool-call demos is mostly padding; run as
    a few micro-batches of similar lengths, the same optimizer step costs about half as much.
    `length`: a demo's length (its tokens'; the RL learner buckets groups of rows by their longest).
    """
    size: Callable[[T], int] = length if length is not None else _token_count
    buckets: list[list[T]] = []
    for demo in sorted(demos, key=size):
        if not buckets or size(demo) > ratio * size(buckets[-1][0]):
            buckets.append([])
        buckets[-1].append(demo)
    return buckets


def _token_count(demo: Any) -> int:
    return len(demo.token_ids)


def collate(demos: Sequence[Masked], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids, attention_mask and loss_mask, all [batch, longest]."""
    longest = max(len(d.token_ids) for d in demos)
    return {
        "input_ids": padded([d.token_ids for d in demos], longest, pad_token_id, torch.long),
        "attention_mask": padded([[1] * len(d.token_ids) for d in demos], longest, 0, torch.long),
        "loss_mask": padded([d.loss_mask for d in demos], longest, 0, torch.float32),
    }


def padded(rows: Sequence[Sequence[Any]], width: int, fill: Any, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), width]: each row followed by `fill` up to `width`, built in one call (filling a tensor
    row by row costs a tensor per row, most of a short micro-batch's collation)."""
    return torch.tensor([[*row, *[fill] * (width - len(row))] for row in rows], dtype=dtype)
