"""SFT demonstrations rendered for training: token IDs plus a loss mask that is 1 exactly on assistant tokens.

The demonstrations themselves come from the environments (their optional `demonstration(rng)`, see
envs/base.py); `DemoStream` mixes their streams and renders each with the chat template.

"Assistant tokens" means what the model itself writes after the generation prompt: the answer, any
tool-call markup, and the EOS that ends the turn. The role header `<|assistant|>` is not one of
them (the harness appends it, as `add_generation_prompt` does), nor are system, user or tool
tokens. This is the same rule as the RL sample's loss mask, so SFT and RL train the same positions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch


@dataclass
class Demo:
    token_ids: list[int]
    loss_mask: list[int]
    """1 where token_ids[j] is a target the model is trained to produce."""


def render_demo(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Demo:
    """Tokenize a conversation with the chat template and mark the assistant-written spans.

    Each assistant span is the difference between the conversation rendered through that message
    and the conversation before it rendered with the generation prompt. The pieces are tokenized
    one by one, which equals tokenizing the whole text because the tokenizer is character-level
    with atomic special tokens.
    """

    def render(upto: int, generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    spans: list[tuple[str, int]] = []
    done = ""
    for index, message in enumerate(messages):
        full = render(index + 1)
        if message["role"] == "assistant":
            prompt = render(index, generation_prompt=True)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise ValueError("chat template is not prefix-stable; cannot mark assistant tokens")
            spans += [(prompt[len(done) :], 0), (full[len(prompt) :], 1)]
        else:
            spans.append((full[len(done) :], 0))
        done = full

    token_ids: list[int] = []
    loss_mask: list[int] = []
    for text, trained in spans:
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        token_ids += ids
        loss_mask += [trained] * len(ids)
    return Demo(token_ids, loss_mask)


class DemoSource(Protocol):
    """Anything with an environment's `demonstration(rng)`: an object with `messages` and `tools`."""

    def demonstration(self, rng: random.Random) -> Any: ...


class DemoStream:
    """An endless, seeded mix of demonstration sources.

    `shares`: (share, source) pairs; each demonstration draws one uniform number and takes the first
    source whose cumulative share exceeds it, `rest` when none does. The sources draw from the same
    seeded generator, so a seed fixes the whole stream.
    """

    def __init__(self, tokenizer, shares: Sequence[tuple[float, DemoSource]], rest: DemoSource, seed: int) -> None:
        if sum(share for share, _ in shares) > 1.0 + 1e-9:
            raise ValueError("the demonstration shares must not exceed 1")
        self.tokenizer, self.shares, self.rest = tokenizer, list(shares), rest
        self.rng = random.Random(seed)

    def next(self) -> Demo:
        draw, bound, source = self.rng.random(), 0.0, self.rest
        for share, candidate in self.shares:
            bound += share
            if draw < bound:
                source = candidate
                break
        demonstration = source.demonstration(self.rng)
        return render_demo(self.tokenizer, demonstration.messages, tools=demonstration.tools)

    def batch(self, size: int) -> list[Demo]:
        return [self.next() for _ in range(size)]


class Masked(Protocol):
    """What bucketing and collation read of a row: its tokens and which of them are trained
    (a demonstration here, a learner row in `batch.py`)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def loss_mask(self) -> list[int]: ...


M = TypeVar("M", bound=Masked)


def length_buckets(demos: list[M], ratio: float = 1.5) -> list[list[M]]:
    """Demos sorted by length and cut wherever a demo is `ratio` times longer than its bucket's first.

    One padded batch of short arithmetic demos and long tool-call demos is mostly padding; run as
    a few micro-batches of similar lengths, the same optimizer step costs about half as much.
    """
    buckets: list[list[M]] = []
    for demo in sorted(demos, key=lambda d: len(d.token_ids)):
        if not buckets or len(demo.token_ids) > ratio * len(buckets[-1][0].token_ids):
            buckets.append([])
        buckets[-1].append(demo)
    return buckets


def collate(demos: Sequence[Masked], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids, attention_mask and loss_mask, all [batch, longest]."""
    longest = max(len(d.token_ids) for d in demos)
    input_ids = torch.full((len(demos), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(demos), longest), dtype=torch.long)
    loss_mask = torch.zeros((len(demos), longest), dtype=torch.float32)
    for row, demo in enumerate(demos):
        n = len(demo.token_ids)
        input_ids[row, :n] = torch.tensor(demo.token_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(demo.loss_mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
