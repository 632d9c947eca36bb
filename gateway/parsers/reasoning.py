"""Thinking sections: `<think>...</think>` (Qwen3, DeepSeek-R1, GLM-4.5/5) returned as `reasoning_content`.

A reply may open its own `<think>`, or start inside one that the chat template opened at the end of
the prompt (then only `</think>` is sampled): both read the same. A reply with no `</think>` has no
reasoning (Qwen3's templates emit an empty `<think></think>` when thinking is off) unless it opened
`<think>` itself, in which case it ran out of tokens while thinking and all of it is reasoning. The
split is made on token IDs when `</think>` is a single token, so the rest of the reply keeps its exact
tokens for the tool-call parser; then only that token closes the section (the tag's characters sampled as
plain tokens are content), and the text is searched only for a tag that is no single token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ThinkParser:
    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag

    def split(self, token_ids: Sequence[int], tokenizer: Any) -> tuple[str | None, list[int] | str]:
        ids = list(token_ids)
        close = _single_token(tokenizer, self.close_tag)
        if close is not None:
            # The tag is a token: only that token closes a thinking section; the same characters
            # sampled as plain tokens are content (text is text).
            if close in ids:
                at = ids.index(close)
                return self._clean(tokenizer.decode(ids[:at], skip_special_tokens=False)), ids[at + 1 :]
            if self._opens(ids, tokenizer):  # cut off while thinking
                return self._clean(tokenizer.decode(ids, skip_special_tokens=False)), ""
            return None, ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if self.close_tag in text:
            reasoning, _, rest = text.partition(self.close_tag)
            return self._clean(reasoning), rest
        if text.lstrip().startswith(self.open_tag):  # cut off while thinking
            return self._clean(text), ""
        return None, ids

    def _opens(self, ids: list[int], tokenizer: Any) -> bool:
        """The reply opens a thinking section itself: its first token but whitespace is the open tag."""
        open_id = _single_token(tokenizer, self.open_tag)
        if open_id is None:
            return tokenizer.decode(ids, skip_special_tokens=False).lstrip().startswith(self.open_tag)
        for token_id in ids:
            if token_id == open_id:
                return True
            if tokenizer.decode([token_id], skip_special_tokens=False).strip():
                return False
        return False

    def _clean(self, reasoning: str) -> str:
        return reasoning.strip().removeprefix(self.open_tag).strip()


def _single_token(tokenizer: Any, text: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(text)
    if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
        return token_id
    return None
