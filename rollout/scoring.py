"""Prefill-only scoring: the log-prob of every given token under a model, from one forward, no sampling.

Cross-stage distillation (distill/) asks each teacher how likely it finds the tokens the student
sampled. That needs no decoding, no sampler and no scheduling, so it is its own small verb beside
the engine's (`EngineFront`) rather than a mode of `generate`: an engine samples, a scorer only reads.

`NativeScorer` runs the embedded engine's native forward (`rollout/models/`, the same code that
samples rollouts and matches the transformers forward within 1e-4) over whole sequences at once,
in a private KV cache, so scoring never competes with an engine's blocks or its cached prefixes.
Built from a checkpoint it holds its own copy of the weights (a distillation teacher);
`NativeScorer.over` wraps an engine's own native model instead, which is how `EmbeddedEngine.score`
scores with the engine's current weights (the gateway's `POST /v1/tokens/score`).
The log-probs are taken at a temperature, as the learner takes them: softmax(logits / T), with
T = 0 (greedy) meaning 1, so a teacher and the student are compared on the same footing.
"""

from __future__ import annotations

import operator
from pathlib import Path

import torch

from asyncrl.records import MIN_TEMPERATURE, RequestError

from .kv_cache import ForwardBatch, KVCache, contiguous_tables
from .models import build_model

DEFAULT_MAX_BATCH_TOKENS = 8192
"""Padded tokens (rows x longest row) in one scoring forward; bounds its memory."""
SCORE_BLOCK = 64
"""Positions per block of the scorer's cache, which it uses as fixed rows (`contiguous_tables`): a block
only ever belongs to one row, so its size is a matter of table length alone."""


def effective_temperature(temperature: float) -> float:
    """The temperature log-probs are taken at: greedy (0) reports raw log-probs, as the engines do."""
    return temperature if temperature > 0 else 1.0


class NativeScorer:
    """Implements `Scorer` with the embedded engine's native forward (CPU or one GPU)."""

    def __init__(
        self,
        model,
        *,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_rows: int = 64,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`model`: a transformers causal LM in memory, or a directory `from_pretrained` can load.
        `max_len`: the longest sequence it will score (None: the model's whole context). Its cache holds
        `max_rows` sequences of that length: at SmolLM2's 8,192 positions, 64 rows are 24 GB, where the
        512 positions a distillation's rollouts hold need 1.5% of that."""
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        config = model.config
        max_len = min(config.max_position_embeddings, max_len or config.max_position_embeddings)
        device = torch.device(device)
        native = build_model(config, model.state_dict(), max_len=max_len, dtype=dtype, device=device)
        self._attach(native, config.vocab_size, max_len, max_batch_tokens, max_rows, dtype, device)

    @classmethod
    def over(
        cls,
        native,
        *,
        vocab_size: int,
        max_len: int,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> NativeScorer:
        """A scorer over an already-built native model (`build_model`'s), sharing its weights, so a
        weight swap on that model (an engine's `update_weights`) is what the next call scores with.

        Its cache holds only as many rows as `max_batch_tokens` allows at `max_len`: an engine's
        scorer should not double the engine's memory for a verb it may never be asked."""
        scorer = cls.__new__(cls)
        max_rows = min(64, max(1, max_batch_tokens // max_len))
        scorer._attach(native, vocab_size, max_len, max_batch_tokens, max_rows, dtype, torch.device(device))
        return scorer

    def _attach(self, native, vocab_size: int, max_len: int, max_batch_tokens: int, max_rows: int, dtype, device) -> None:
        self.model, self.device = native, device
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.max_batch_tokens = max(max_batch_tokens, self.max_len)  # the longest sequence always fits
        self.max_rows = max_rows
        self.tables = contiguous_tables(max_rows, max_len, SCORE_BLOCK)
        blocks = max_rows * len(self.tables[0])
        self.cache = KVCache(native.cache_layout(), blocks, SCORE_BLOCK, max_len=max_len, dtype=dtype, device=device)

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per sequence, the log-prob of each token given the ones before it, aligned with the
        sequence: entry 0 is 0.0 (nothing predicts the first token). Bad input is a RequestError."""
        if not 0.0 <= temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {temperature}")
        if 0.0 < temperature < MIN_TEMPERATURE:  # logits / 1e-300 overflow: NaN log-probs
            raise RequestError(f"temperature {temperature} is too small to score with; use 0 for raw log-probs")
        rows = [self._validate(i, sequence) for i, sequence in enumerate(sequences)]
        scores: dict[int, list[float]] = {}
        for chunk in self._chunks(rows):
            scores.update(zip(chunk, self._forward([rows[i] for i in chunk], effective_temperature(temperature)), strict=True))
        return [scores[i] for i in range(len(rows))]

    def _validate(self, index: int, sequence) -> list[int]:
        try:
            tokens = [operator.index(t) for t in sequence]
        except TypeError as error:
            raise RequestError(f"sequence {index}: token ids must be integers: {error}") from None
        if not tokens:
            raise RequestError(f"sequence {index} is empty")
        if len(tokens) > self.max_len:
            raise RequestError(f"sequence {index} has {len(tokens)} tokens, more than the model's {self.max_len}")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"sequence {index}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens

    def _chunks(self, rows: list[list[int]]) -> list[list[int]]:
        """Indices of rows, longest first, cut so no forward exceeds max_rows or max_batch_tokens padded."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        chunks: list[list[int]] = []
        for i in order:
            if chunks and len(chunks[-1]) < self.max_rows and (len(chunks[-1]) + 1) * len(rows[chunks[-1][0]]) <= self.max_batch_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    @torch.inference_mode()
    def _forward(self, rows: list[list[int]], temperature: float) -> list[list[float]]:
        # Every row starts at position 0 and writes its own K/V before reading it, so whatever an
        # earlier chunk left in its blocks is never seen by a real token.
        batch = ForwardBatch.build(self.tables[: len(rows)], rows, [0] * len(rows), SCORE_BLOCK, self.device)
        logits = self.model.logits(self.model.hidden_states(batch, self.cache)).float() / temperature
        chosen = logits[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        logprobs = (chosen - torch.logsumexp(logits[:, :-1], dim=-1)).cpu()
        return [[0.0, *logprobs[b, : len(row) - 1].tolist()] for b, row in enumerate(rows)]
