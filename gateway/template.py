"""Rendering and encoding a chat prompt, once per turn, on the gateway's hot path; text stays text.

Text is text: a marker (an added token: a role tag, tool-call markup, EOS) enters a prompt only
where the chat template writes it, never because a message, a tool result or a tool-call argument
spells its text. Before rendering, every string the template sees (message content, tool-call names,
argument keys and values, tool definitions) gets a BREAK (U+FDD0, a Unicode noncharacter, reserved
for uses like this one) after the first character of every marker text it contains; `encode` splits
the rendered text at BREAKs and encodes the pieces separately, so no piece holds a whole marker text
and the BREAK itself is never encoded: "<|user|>" in content is 8 plain tokens. Strings without
marker text are passed as they are, so for nearly every request the render, the one encode and the
ids are what they were without this. The template sees content otherwise unchanged (trimming,
splitting on its own markers still work, though a marker spelled in content no longer splits).
A literal U+FDD0 in content becomes U+FFFD. Assumed: a template writes markers whole, never part of
one as plain text next to content. Markers are the added tokens that are special, or that the chat
template writes (Qwen's non-special `<tool_call>`), of two or more characters that are not all
whitespace; a one-character marker cannot be split and is not guarded.

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

import functools
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta

try:  # transformers' cached compiler, exactly what apply_chat_template renders with
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from transformers.utils.chat_template_utils import _compile_jinja_template

    _COMPILED = True
except ImportError:  # another transformers layout: the tokenizer's own calls are always right
    _COMPILED = False

_NO_KWARGS: Mapping[str, Any] = {}
_SPECIAL_TOKEN_NAMES = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token", "additional_special_tokens"}
)
BREAK = "\ufdd0"
"""Put inside marker texts that content spells; `encode` splits there and never encodes it."""
_REPLACEMENT = "\ufffd"
LARGE_TEXT = 4096
"""Characters above which the Rust tokenizer is called through its batch API, which releases the GIL
(its one-text call holds it: a thread encoding a big prompt would stall the event loop anyway)."""


class Markup:
    """A tokenizer's marker texts, and how to keep a string from spelling them (see the module doc)."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids: dict[int, str] = _marker_ids(tokenizer)
        texts = sorted(set(self.ids.values()))
        firsts = {text[0] for text in texts}
        # One leading character (the tiny tokenizer's "<"): a `str.__contains__` rules most strings out.
        self._first = next(iter(firsts)) if len(firsts) == 1 else None
        pattern = _trie_pattern(texts)
        self._any = re.compile(pattern) if texts else None
        self._starts = re.compile(f"(?=(?:{pattern}))") if texts else None
        # JSON writes these markers as they are, so one search of a value's JSON rules the whole value out.
        self._json_searchable = all(json.dumps(text, ensure_ascii=False) == f'"{text}"' for text in texts)

    def escape(self, text: str) -> str:
        """`text` with a BREAK after the first character of every marker text in it (overlapping ones too)."""
        if BREAK in text:
            text = text.replace(BREAK, _REPLACEMENT)
        if self._any is None or (self._first is not None and self._first not in text):
            return text
        found = self._any.search(text)
        if found is None or self._starts is None:
            return text
        cuts = [m.start() + 1 for m in self._starts.finditer(text, found.start())]
        return BREAK.join(text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)]))

    def count(self, text: str) -> int:
        """Marker texts in `text` (non-overlapping)."""
        if self._any is None or (self._first is not None and self._first not in text):
            return 0
        return len(self._any.findall(text))

    def messages(self, messages: Sequence[Mapping]) -> Sequence[Mapping]:
        """Template-form messages (`to_template_messages`) with their strings escaped; the same list when none needed it."""
        out = None
        for i, message in enumerate(messages):
            escaped = self._message(message)
            if escaped is not message:
                out = list(messages) if out is None else out
                out[i] = escaped
        return messages if out is None else out

    def _message(self, message: Mapping) -> Mapping:
        content = message.get("content")
        new_content = self.escape(content) if isinstance(content, str) else self.value(content)
        calls = message.get("tool_calls")
        new_calls = self.value(calls) if calls else calls
        reasoning = message.get("reasoning_content")
        new_reasoning = self.escape(reasoning) if isinstance(reasoning, str) else reasoning
        if new_content is content and new_calls is calls and new_reasoning is reasoning:
            return message
        out = {**message, "content": new_content, **({"tool_calls": new_calls} if calls else {})}
        if new_reasoning is not reasoning:
            out.update(thinking=new_reasoning, reasoning_content=new_reasoning)
        return out

    def value(self, value: Any) -> Any:
        """Any JSON value with every string in it (keys too) escaped; the same object when none needed it."""
        if self._any is None or isinstance(value, str) or not value:
            return self._value(value)
        if self._json_searchable:
            # Tool definitions come with every request: one C-level dump and search instead of a walk in Python.
            try:
                flat = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError):
                flat = None
            if flat is not None and BREAK not in flat and self._any.search(flat) is None:
                return value
        return self._value(value)

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            items = [(self._value(k), self._value(v)) for k, v in value.items()]
            same = all(new[0] is old[0] and new[1] is old[1] for new, old in zip(items, value.items(), strict=True))
            return value if same else dict(items)
        if isinstance(value, (list, tuple)):
            values = [self._value(v) for v in value]
            return value if all(new is old for new, old in zip(values, value, strict=True)) else values
        return value


def _template_source(tokenizer: Any) -> str:
    """All of the tokenizer's chat template text (every named template, where it has several)."""
    template = getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, Mapping) else [template]
    return "".join(s for s in sources if isinstance(s, str))


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The undeclared names of a Jinja template but its environment's globals: the variables it reads from its context."""
    if not source:
        return frozenset()
    try:
        environment = (
            _compile_jinja_template(source).environment if _COMPILED else jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        )
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)) - set(environment.globals))
    except Exception:  # a template jinja cannot parse (it fails at render too): every identifier in it
        return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source))


def _marker_ids(tokenizer: Any) -> dict[int, str]:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    source = _template_source(tokenizer)
    markers = {}
    for token_id, token in added.items():
        text = getattr(token, "content", str(token))
        if len(text) > 1 and not text.isspace() and (getattr(token, "special", True) or text in source):
            markers[token_id] = text
    return markers


def _trie_pattern(texts: Sequence[str]) -> str:
    """A regex for any of `texts`, longest first, as a trie: each position is tried once, not once per text."""
    trie: dict = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def walk(node: dict) -> str:
        branches = [re.escape(char) + walk(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return walk(trie)


class TokenizerTemplate:
    """The tokenizer's own calls (any object with `apply_chat_template` and `encode`), text kept as text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._markup_for: tuple[Any, Markup] | None = None

    @property
    def markup(self) -> Markup:
        """The markers for the tokenizer's current chat template (a replaced template can add some)."""
        template = getattr(self.tokenizer, "chat_template", None)
        cached = self._markup_for
        if cached is None or cached[0] is not template:
            cached = self._markup_for = (template, Markup(self.tokenizer))
        return cached[1]

    @property
    def variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (what `template_kwargs` may set)."""
        return template_variables(_template_source(self.tokenizer))

    @property
    def reserved_variables(self) -> frozenset[str]:
        """Variables every render sets from the tokenizer (`bos_token`, ...): a request must not replace them."""
        return _SPECIAL_TOKEN_NAMES | frozenset(getattr(self.tokenizer, "special_tokens_map", None) or ())

    def render(
        self, messages: Sequence[dict], tools: list[dict] | None, *, generation_prompt: bool, template_kwargs: Mapping | None = None
    ) -> str:
        """The prompt text, content escaped (`encode` reads it; it is not for showing). `template_kwargs`:
        extra template variables (`enable_thinking`, ...), as `toolcalls.to_template_kwargs` returns them."""
        markup = self.markup
        kwargs = markup.value(template_kwargs) if template_kwargs else _NO_KWARGS
        return self._render(markup.messages(messages), markup.value(tools), generation_prompt, kwargs)

    def _render(self, messages: Sequence[Mapping], tools: list[dict] | None, generation_prompt: bool, kwargs: Mapping) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text: markers where the template wrote them, content as plain tokens."""
        if BREAK not in text:
            return self._encode(text) if text else []
        return [token for piece in text.split(BREAK) if piece for token in self._encode(piece)]

    def _encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS included, where a model has one) as text.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """Ids of raw text with no markers at all (a text prompt): marker texts in it are plain tokens."""
        return self.encode(self.markup.escape(text))

    def marker_id(self, text: str) -> int | None:
        """The id of the marker whose text is exactly `text`, if any."""
        return next((token_id for token_id, marker in self.markup.ids.items() if marker == text), None)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Sampled tokens as `render` would write them back: marker tokens as their text, marker texts
        the model spelled in plain tokens escaped (so an echoed reply renders to the same text)."""
        markup, ids = self.markup, list(token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if BREAK not in text and markup.count(text) == sum(1 for token in ids if token in markup.ids):
            return text  # every marker text came from a marker token
        pieces = []
        for is_marker, run in itertools.groupby(ids, key=markup.ids.__contains__):
            piece = self.tokenizer.decode(list(run), skip_special_tokens=False)
            pieces.append(piece if is_marker else markup.escape(piece))
        return "".join(pieces)


class CompiledTemplate(TokenizerTemplate):
    """The same results without the per-call layers, for a `TokenizersBackend` (fast) tokenizer.

    `render` takes messages, tools and template kwargs as `to_template_messages` / `to_template_tools` /
    `to_template_kwargs` return them: plain JSON values, no None-valued message keys, reasoning already
    under both of transformers' names (the layers skipped here exist to normalise anything else).
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._backend = tokenizer._tokenizer

    def _render(self, messages: Sequence[Mapping], tools: list[dict] | None, generation_prompt: bool, kwargs: Mapping) -> str:
        # Looked up per call (transformers caches the compiled template), so a replaced template is used.
        compiled = _compile_jinja_template(self.tokenizer.get_chat_template(None, tools))
        variables = {**self.tokenizer.special_tokens_map, **kwargs} if kwargs else self.tokenizer.special_tokens_map
        return compiled.render(messages=messages, tools=tools, documents=None, add_generation_prompt=generation_prompt, **variables)

    def encode(self, text: str) -> list[int]:
        backend = self._backend
        # `encode` switches the shared backend's truncation and padding off before encoding; where
        # another caller left them on, only that call gives the same ids.
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
            return super().encode(text)
        if not text:
            return []
        pieces = [piece for piece in text.split(BREAK) if piece] if BREAK in text else [text]
        if len(text) > LARGE_TEXT:
            return [token for encoding in backend.encode_batch(pieces, add_special_tokens=False) for token in encoding.ids]
        if len(pieces) == 1:
            return backend.encode(pieces[0], add_special_tokens=False).ids
        return [token for piece in pieces for token in backend.encode(piece, add_special_tokens=False).ids]


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
