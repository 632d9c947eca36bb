"""Rendering and encoding a chat prompt, once per turn, on the gateway's hot path.

`apply_chat_template` and `encode` wrap their work in layers built for arbitrary callers: every
message is walked twice and rebuilt (objects to dicts, None keys dropped, rich values made inert),
and `encode` goes through the batch API and the padding/truncation set-up. On the gateway that was
more than the template's own rendering (140 vs 64 µs a render, 13 vs 5 µs an encode, hot; the
one-item batch cost ~0.2 ms a call in the served gateway). The gateway's messages are already plain
JSON values in the template's form (`toolcalls.to_template_messages`), so `CompiledTemplate` renders
them with the compiled template and encodes with the Rust tokenizer directly; what comes out is
what the tokenizer's own calls return (tests compare the two). Tokenizers it cannot vouch for get
`TokenizerTemplate`, the tokenizer's own calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:  # transformers' cached compiler, exactly what apply_chat_template renders with
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from transformers.utils.chat_template_utils import _compile_jinja_template

    _COMPILED = True
except ImportError:  # another transformers layout: the tokenizer's own calls are always right
    _COMPILED = False


class TokenizerTemplate:
    """The tokenizer's own calls (any object with `apply_chat_template` and `encode`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS included, where a model has one) as text.
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


class CompiledTemplate(TokenizerTemplate):
    """The same results without the per-call layers, for a `TokenizersBackend` (fast) tokenizer.

    `render` takes messages and tools as `to_template_messages` / `to_template_tools` return them:
    plain JSON values, no None-valued message keys, no reasoning fields (the layers skipped here
    exist to normalise anything else).
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._backend = tokenizer._tokenizer

    def render(self, messages: Sequence[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
        # Looked up per call (transformers caches the compiled template), so a replaced template is used.
        compiled = _compile_jinja_template(self.tokenizer.get_chat_template(None, tools))
        return compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **self.tokenizer.special_tokens_map,
        )

    def encode(self, text: str) -> list[int]:
        backend = self._backend
        # `encode` switches the shared backend's truncation and padding off before encoding; where
        # another caller left them on, only that call gives the same ids.
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
            return super().encode(text)
        return backend.encode(text, add_special_tokens=False).ids if text else []


def chat_template(tokenizer: Any) -> TokenizerTemplate:
    """The fastest exact renderer for `tokenizer`: `CompiledTemplate` for a plain fast tokenizer
    (not a subclass that changes how it encodes), else the tokenizer's own calls."""
    plain = (
        _COMPILED
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
        and type(tokenizer).encode is TokenizersBackend.encode
        and type(tokenizer).apply_chat_template is TokenizersBackend.apply_chat_template
        and not getattr(tokenizer, "split_special_tokens", False)
    )
    return CompiledTemplate(tokenizer) if plain else TokenizerTemplate(tokenizer)
