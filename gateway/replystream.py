"""A reply as it is sampled: its text decoded token by token, split into reasoning and content as far as
no later token can change them. Shared by the OpenAI and Anthropic streams.

The agent must end up with what the non-streamed call returns, because it sends that back and the
conversation matches it token-exactly. So a piece of text is sent only once the final parse
(`service.parse`, at the end) must begin with it: content stops before anything that may open a tool
call (the parser's markup, or a partial one at the end), trailing whitespace waits for what follows
(parsers strip it), and reasoning is read only with a reasoning parser that declares its tags
(`open_tag` / `close_tag`, as `ThinkParser` does). What a parser may still reshape waits for the end;
then `finish` sends the rest of each field, and the tool calls come whole. Replies the live split
cannot foresee (a close tag in a reply whose template did not open thinking, thinking cut off by
max_tokens) end with what was sent plus nothing: the agent's echo then starts a new branch.

Decoding is exact for characters split across tokens (byte-level BPE): text is released only once
its bytes are whole, by decoding from a token of context before the new ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

from tokenizers import Tokenizer

from .parsers.glm import GlmParser
from .parsers.json_calls import HermesParser, Llama3JsonParser
from .toolcalls import MARKERS, ParsedCompletion

Field = Literal["reasoning", "content"]
Delta = tuple[Field, str]

REPLACEMENT = "\ufffd"


def stream_markers(tool_parser: Any) -> tuple[str, ...] | None:
    """Text that may begin a tool call in `tool_parser`'s markup; None: the content is held to the end.
    A plug-in parser opts in with a `stream_markers` attribute."""
    declared = getattr(tool_parser, "stream_markers", None)
    if declared is not None:
        return tuple(declared)
    if isinstance(tool_parser, GlmParser):
        return MARKERS  # any stray tag makes the whole reply content, so none may be sent early
    if isinstance(tool_parser, HermesParser):
        return ("<tool_call>", "</tool_call>")
    return None


def plain_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=False)`, straight from the Rust tokenizer where that is what
    it runs (a fast tokenizer that cleans up no spaces): transformers' wrapper around it costs more than the
    decoding of a token or two, and a stream decodes twice a token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=False)
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


class IncrementalDecoder:
    """Token ids in, new text out; the concatenated output is the decoded text of all tokens but `skip`."""

    def __init__(self, tokenizer: Any, skip: Sequence[int] = ()) -> None:
        self.tokenizer, self.skip = tokenizer, frozenset(skip)
        self._decode = plain_decoder(tokenizer)
        self.ids: list[int] = []
        self._prefix = 0
        """Where the decoded context starts (a token before the unreleased ones)."""
        self._read = 0
        """Tokens whose text has been released."""

    def feed(self, token_ids: Sequence[int]) -> str:
        self.ids += [t for t in token_ids if t not in self.skip]
        if len(self.ids) == self._read:
            return ""
        released = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(released) or text.endswith(REPLACEMENT):
            return ""  # an incomplete character at the end: wait for its other bytes
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(released) :]

    def flush(self) -> str:
        """The rest, whole or not (the reply ended)."""
        released = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(released) :] if text.startswith(released) else ""


Span = tuple[int, int]
"""(start, end) of a field's settled text in the reply's text."""


class ReplyStream:
    """The reasoning and content deltas of one reply: `feed` each TokenDelta's ids, then `finish` with the parse.

    Each feed costs about what its new text does: the tags and markers already looked for are not looked
    for again, and the fields are spans of the text, not copies of it."""

    def __init__(self, tokenizer: Any, tool_parser: Any, reasoning_parser: Any, prompt_token_ids: Sequence[int]) -> None:
        eos = getattr(tokenizer, "eos_token_id", None)
        self.decoder = IncrementalDecoder(tokenizer, [eos] if isinstance(eos, int) else [])
        self.text = ""
        self.sent: dict[Field, str] = {"reasoning": "", "content": ""}
        self._spans: dict[Field, Span] = {}
        """What was sent live of each field, as a span (its start stays put)."""
        self._frozen: set[Field] = set()
        """Fields the live split got wrong (their start moved): the rest waits for `finish`."""
        self.markers = stream_markers(tool_parser)
        self.leading_json = isinstance(tool_parser, Llama3JsonParser)
        self.thinking = reasoning_parser is not None
        self.tags: tuple[str, str] | None = None
        if reasoning_parser is not None:
            open_tag, close_tag = getattr(reasoning_parser, "open_tag", None), getattr(reasoning_parser, "close_tag", None)
            if isinstance(open_tag, str) and isinstance(close_tag, str) and open_tag and close_tag:
                self.tags = (open_tag, close_tag)
        tail = tokenizer.decode(list(prompt_token_ids[-8:]), skip_special_tokens=False).rstrip() if self.tags else ""
        self.opened = self.tags is not None and tail.endswith(self.tags[0])
        """The chat template opened the thinking section at the end of the prompt."""
        self._close = _Search()
        self._marker = _Search()

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        new = self.decoder.feed(token_ids)
        if not new:
            return []
        self.text += new
        deltas: list[Delta] = []
        for name, span in self._settled().items():
            if span is None or name in self._frozen:
                continue
            start, end = span
            sent_start, sent_end = self._spans.get(name, (start, start))
            if sent_start != start or end < sent_end:
                self._frozen.add(name)
            elif end > sent_end:
                piece = self.text[sent_end:end]
                deltas.append((name, piece))
                self.sent[name] += piece
                self._spans[name] = (start, end)
        return deltas

    def finish(self, parsed: ParsedCompletion) -> list[Delta]:
        """The rest of each field as the final parse has it."""
        self.text += self.decoder.flush()
        deltas: list[Delta] = []
        final: dict[Field, str] = {"reasoning": parsed.reasoning_content or "", "content": parsed.content or ""}
        for name, value in final.items():
            sent = self.sent[name]
            if len(value) > len(sent) and value.startswith(sent):
                deltas.append((name, value[len(sent) :]))
                self.sent[name] = value
        return deltas

    def _settled(self) -> dict[Field, Span | None]:
        """The span each field's final value must begin with, whatever is sampled next (None: not known yet)."""
        text = self.text
        if not self.thinking:
            return {"content": self._content(0)}
        if self.tags is None:
            return {}
        open_tag, close_tag = self.tags
        close = self._close.find(text, (close_tag,), 0)
        if close >= 0:
            start = close + len(close_tag)
            while start < len(text) and text[start] == "\n":
                start += 1
            return {"reasoning": self._thought(close), "content": self._content(start)}
        first = _first_non_space(text, 0)
        rest = len(text) - first
        if rest <= len(open_tag) and open_tag.startswith(text[first:]):
            return {}  # nothing yet, or (part of) the open tag: it may be opening a thinking section
        if self.opened or text.startswith(open_tag, first):
            return {"reasoning": self._thought(_partial_cut(text, 0, len(text), (close_tag,))), "content": None}
        return {"content": self._content(0)}

    def _thought(self, end: int) -> Span:
        """text[:end] as the reasoning parser cleans it: stripped, without the open tag."""
        assert self.tags is not None
        text, open_tag = self.text, self.tags[0]
        start = _first_non_space(text, 0, end)
        if text.startswith(open_tag, start, end):
            start = _first_non_space(text, start + len(open_tag), end)
        return start, _stripped_end(text, start, end)

    def _content(self, start: int) -> Span | None:
        text = self.text
        if self.leading_json:
            first, tag = _first_non_space(text, start), Llama3JsonParser.PYTHON_TAG
            if text.startswith(("{", tag), first) or tag.startswith(text[first : first + len(tag)]):
                return None  # the whole reply may be a call
            return start, _stripped_end(text, start, len(text))
        if self.markers is None:
            return None
        marker = self._marker.find(text, self.markers, start)
        end = marker if marker >= 0 else _partial_cut(text, start, len(text), self.markers)
        return start, _stripped_end(text, start, end)


class _Search:
    """The first occurrence of any of some strings in a growing text, from a start, scanning each part once."""

    def __init__(self) -> None:
        self.start, self.scanned, self.found = -1, 0, -1

    def find(self, text: str, needles: Sequence[str], start: int) -> int:
        if start != self.start:
            self.start, self.scanned, self.found = start, start, -1
        if self.found < 0:
            back = max(len(n) for n in needles) - 1
            since = max(start, self.scanned - back)
            firsts, fresh = _first_characters(tuple(needles)), text[since:]
            if firsts is None or any(first in fresh for first in firsts):  # mostly not: one scan a character
                hits = [at for at in (text.find(n, since) for n in needles) if at >= 0]
                self.found = min(hits, default=-1)
            self.scanned = len(text)
        return self.found


@functools.lru_cache(maxsize=64)
def _first_characters(needles: tuple[str, ...]) -> frozenset[str] | None:
    """What each needle starts with (None: an empty needle, found anywhere)."""
    return None if not all(needles) else frozenset(n[0] for n in needles)


def _first_non_space(text: str, start: int, end: int | None = None) -> int:
    end = len(text) if end is None else end
    while start < end and text[start].isspace():
        start += 1
    return start


def _stripped_end(text: str, start: int, end: int) -> int:
    """`end` before trailing whitespace (it waits for what follows: parsers strip it)."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def _partial_cut(text: str, start: int, end: int, tags: Sequence[str]) -> int:
    """`end` before a trailing proper prefix of any of `tags` (the start of a tag still being sampled)."""
    prefixes, firsts, longest = _proper_prefixes(tuple(tags))
    for at in range(max(start, end - longest), end):  # the longest such prefix first
        if text[at] in firsts and text[at:end] in prefixes:
            return at
    return end


@functools.lru_cache(maxsize=64)
def _proper_prefixes(tags: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], int]:
    """(every proper prefix of the tags, their first characters, the longest prefix's length)."""
    prefixes = frozenset(tag[:size] for tag in tags for size in range(1, len(tag)))
    return prefixes, frozenset(p[0] for p in prefixes), max((len(p) for p in prefixes), default=0)
