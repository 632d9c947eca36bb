"""Token-exact multi-turn: the prompt of every turn starts with the exact tokens of the turns before.

A `Conversation` (one per rollout) keeps branches. A branch holds the exact token IDs so far, the
rendered prompts and the sampled completions bit for bit, and the (normalised) messages they stand
for, with a mark at every turn boundary: `marks[n] = t` means the first n messages are exactly the
first t tokens.

For a request with messages M, the longest recorded prefix of M that ends on a mark is reused as
tokens, and only the rest of M is tokenized. The suffix is never tokenized together with earlier
text: the template renders M once, the rendering must start with the text the reused tokens were
made from (kept per mark: the rendered prompt text plus the decoded completion), and only the
difference is tokenized (exact for the char-level tokenizer, and never re-tokenizes earlier turns
for a BPE one). That is one render per turn whenever the template renders earlier turns as they
were sampled; otherwise (the model wrote " code " where the template writes "code", a turn cut at
max_tokens that the template closes with EOS, or the template rewrites history) the template also
renders M[:k], the full text must start with that, and the difference is tokenized. (The two agree
wherever both apply, except for a template that writes text after a turn's closing token, like
ChatML's newline after <|im_end|>: one render keeps that text in the next prompt, as the template
does; rendering M[:k] as well would drop it.) When the agent rewrote its context, the request's prefix match ends before
the branch does and the conversation forks: the new branch keeps the exact tokens of the shared
turns. Nothing matching (or a template that is not prefix-stable) starts a branch rendered fresh.
Rendered text is kept as the template module writes it (content escaped, `template.BREAK`), so message
text is encoded as text and markers come only from the template.

Template kwargs (`enable_thinking`, `reasoning_effort`: thinking switched per request) are part of the
render, and each mark remembers the kwargs every turn up to it was rendered with. A request with other
kwargs reuses a mark only where its own rendering starts with the exact text the reused tokens were made
from (Qwen3's `enable_thinking=false` changes only the generation prompt: the branch goes on); rendering
M[:k] again under the new kwargs proves nothing about tokens made under the old ones (GLM's switch appends
`/nothink` to every earlier user message), so there the trajectory forks, reason "template". An echoed
reply's `reasoning_content` is part of its message; a template that drops old reasoning forks at the
next user query ("template"), one that keeps it stays one branch.

`max_branches` holds under concurrent calls: a branch is created at commit, after the generation, so
`prepare` reserves one for every call that may fork (one with no branch to extend, and every call
after the first on a branch several are extending at once: all but the first to commit fork), refuses
a call the reservations leave no room for, and `commit` checks again. A prepared turn that will not be
committed gives its reservation back with `release`.

Threads: `prepare` is `plan` (cheap: match the messages), `render` (the CPU work: render and encode;
it only reads the branches, so it may run in a worker thread while the caller keeps other `prepare`s
and `commit`s of this conversation waiting) and `admit` (the reservation). Everything but `render`
runs on the caller's thread; the gateway serializes prepare and commit per rollout with a lock.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .template import TokenizerTemplate
from .toolcalls import to_template_kwargs, to_template_messages, to_template_tools

MessageKey = tuple[str, str, tuple[tuple[str, str], ...]] | tuple[str, str, tuple[tuple[str, str], ...], str]
_MIXED = "\x00mixed"
"""`Branch.kwargs_marks` value of a mark whose turns were rendered with different template kwargs."""
ForkReason = Literal["fresh", "rewrite", "concurrent", "template"]


class ConversationError(ValueError):
    """A request this conversation refuses (too many branches); the gateway answers it with a 4xx."""


def message_key(message: Mapping) -> MessageKey:
    """What makes two template-form messages the same turn: role, text, tool calls, reasoning.

    Tool-call ids, names of tool results and argument key order are ignored: agents regenerate ids
    and re-serialise JSON, and treating those echoes as rewrites would fork every turn.
    """
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True, ensure_ascii=False))
        for c in message.get("tool_calls") or ()
    )
    if "reasoning_content" in message:
        return (message["role"], message.get("content") or "", calls, message["reasoning_content"])
    return (message["role"], message.get("content") or "", calls)


@dataclass
class Branch:
    """One line of the conversation. Sample assembly decides forks from the tokens themselves; the
    branch id is a label for records and replay."""

    id: int
    token_ids: list[int]
    messages: list[MessageKey]
    marks: dict[int, int]
    """message count -> token count at each turn boundary (after a sampled assistant message)."""
    tools_key: str
    parent: int | None = None
    fork_reason: ForkReason = "fresh"
    turns: int = 0
    """Turns committed on this branch itself (turns inherited from the parent not counted)."""
    text: str | None = None
    """The text the tokens were made from: rendered prompt text and decoded completions (None: unknown)."""
    text_marks: dict[int, int] = field(default_factory=dict)
    """message count -> length of `text` at that turn boundary (marks whose text is known)."""
    unclosed: set[int] = field(default_factory=set)
    """Marks after a turn that did not end with EOS (cut at max_tokens): always rendered twice."""
    kwargs_marks: dict[int, str] = field(default_factory=dict)
    """message count -> the template kwargs (canonical JSON) all turns up to that mark were rendered with;
    absent: none."""


@dataclass(frozen=True)
class Plan:
    """A request matched against the recorded branches (`Conversation.plan`); `render` makes its prompt."""

    messages: list[dict]
    keys: tuple[MessageKey, ...]
    tools: list[dict] | None
    tools_key: str
    source: Branch | None
    """The branch whose first `reused_messages` messages are the request's (None: nothing matches)."""
    reused_messages: int
    new_chars: int
    """Characters of the messages (and, for a fresh render, the tools) past the reused ones: the text to encode."""
    chars: int
    """Characters of all messages: what the template renders."""
    template_kwargs: dict | None = None
    kwargs_key: str = ""
    """`template_kwargs` as canonical JSON ("" for none)."""


@dataclass(frozen=True)
class Draft:
    """A rendered prompt before `admit` gives it a turn index and a reservation."""

    target: int | None
    """The branch the turn extends (None: a new branch)."""
    prompt_token_ids: list[int]
    reused_tokens: int
    source: int | None
    base_messages: int
    keys: tuple[MessageKey, ...]
    tools_key: str
    reason: ForkReason
    text: str | None
    kwargs_key: str = ""


@dataclass(frozen=True)
class Prepared:
    """What `prepare` decided; unpacks as `branch_id, prompt_token_ids, turn_index`."""

    branch_id: int
    """The branch this turn extends, or (for a new branch) the id `commit` will most likely give it."""
    prompt_token_ids: list[int]
    turn_index: int
    """Unique per call within the conversation, in call order (failed calls leave gaps)."""
    reused_tokens: int
    """Leading prompt tokens taken verbatim from earlier turns."""
    _source: int | None = field(repr=False)
    _base_messages: int = field(repr=False)
    _messages: tuple[MessageKey, ...] = field(repr=False)
    _tools_key: str = field(repr=False)
    _fork_reason: ForkReason = field(repr=False)
    _text: str | None = field(repr=False, default=None)
    """The text the prompt tokens were made from (None: not known)."""
    _kwargs_key: str = field(repr=False, default="")

    def __iter__(self):
        return iter((self.branch_id, self.prompt_token_ids, self.turn_index))


_FORK = (-1, -1)
"""The claim of a prepared call with no branch to extend: it will create one."""


class Conversation:
    """The token-exact state of one rollout. `tokenizer`: a Hugging Face tokenizer with a chat template;
    `template` renders and encodes for it (default: the tokenizer's own calls; the gateway passes
    one `template.chat_template(tokenizer)` to all its conversations)."""

    def __init__(self, tokenizer: Any, *, max_branches: int | None = None, template: TokenizerTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template or TokenizerTemplate(tokenizer)
        self.max_branches = max_branches
        self._branches: dict[int, Branch] = {}
        self._next_branch = 0
        self._calls = 0
        self._pending: dict[int, tuple[int, int]] = {}
        """turn index -> claim of each prepared call not yet committed or released: _FORK, or the
        (branch id, its message count) it extends."""
        self._claims: Counter[tuple[int, int]] = Counter()

    @property
    def branches(self) -> list[Branch]:
        return list(self._branches.values())

    def branch(self, branch_id: int) -> Branch:
        return self._branches[branch_id]

    def prepare(
        self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, template_kwargs: Mapping | None = None
    ) -> Prepared:
        """The exact prompt token IDs for a chat request (OpenAI messages and tools, template kwargs).

        Raises `toolcalls.MessageError` for messages or kwargs it cannot render and `ConversationError`
        when a new branch would exceed `max_branches`.
        """
        return self.admit(self.render(self.plan(messages, tools, template_kwargs)))

    def plan(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, template_kwargs: Mapping | None = None) -> Plan:
        """Validate and match the request: which recorded turns it reuses, how much text is new."""
        kwargs, kwargs_key = (
            to_template_kwargs(template_kwargs, self.template.variables, self.template.reserved_variables)
            if template_kwargs
            else (None, "")
        )
        msgs, tool_defs = to_template_messages(messages), to_template_tools(tools)
        keys = tuple(message_key(m) for m in msgs)
        tools_key = json.dumps(tool_defs, sort_keys=True, ensure_ascii=False)
        source, k = self._longest_match(keys, tools_key)
        if source is not None and keys[:k] != tuple(source.messages[:k]):
            msgs, keys = _restore_reasoning(msgs, keys, source.messages, k)
        sizes = [_chars(m) for m in msgs]
        new_chars = sum(sizes[k:]) + (0 if k else len(tools_key))
        return Plan(msgs, keys, tool_defs, tools_key, source, k, new_chars, sum(sizes), kwargs, kwargs_key)

    def render(self, plan: Plan) -> Draft:
        """Render and encode the prompt of `plan`. Reads the branches and changes nothing."""
        msgs, tool_defs, keys, tools_key, kwargs = plan.messages, plan.tools, plan.keys, plan.tools_key, plan.template_kwargs
        full = self.template.render(msgs, tool_defs, generation_prompt=True, template_kwargs=kwargs)
        source, k = plan.source, plan.reused_messages
        reason: ForkReason = "fresh" if not self._branches else "rewrite"
        if source is not None:
            end = source.text_marks.get(k)
            made_from = source.text[:end] if end is not None and source.text is not None else None
            prefix: str | None
            if made_from is not None and k not in source.unclosed and full.startswith(made_from):
                prefix = made_from  # the template renders the reused turns as they are: one render
            elif source.kwargs_marks.get(k, "") == plan.kwargs_key:
                prefix = self.template.render(msgs[:k], tool_defs, generation_prompt=False, template_kwargs=kwargs)
            else:
                prefix = None  # the reused tokens were rendered with other kwargs: only their own text vouches for them
            if prefix is not None and full.startswith(prefix):
                base = source.token_ids[: source.marks[k]]
                suffix = full[len(prefix) :]
                if prefix is not made_from:
                    suffix = self._after_stop(base, suffix)
                prompt = base + self.template.encode(suffix)
                target = source.id if k == len(source.messages) else None  # None: a fork at mark k
                text = None if made_from is None else made_from + suffix
                return Draft(target, prompt, len(base), source.id, k, keys, tools_key, reason, text, plan.kwargs_key)
            reason = "template"  # the template rewrites earlier turns (drops old reasoning, or renders them otherwise under these kwargs)
        return Draft(None, self.template.encode(full), 0, None, 0, keys, tools_key, reason, full, plan.kwargs_key)

    def _after_stop(self, base: list[int], suffix: str) -> str:
        """`suffix` without the marker the reused turn ended on, where the template writes that marker next:
        a model that ends its turn on the next turn's tag (GLM-4.5 stops on `<|observation|>` / `<|user|>`)
        sampled it already."""
        stop = self.template.markup.ids.get(base[-1]) if base else None
        return suffix[len(stop) :] if stop is not None and suffix.startswith(stop) else suffix

    def admit(self, draft: Draft) -> Prepared:
        """Number the call and reserve the branch it may create; `ConversationError` past `max_branches`."""
        claim = _FORK if draft.target is None else (draft.target, draft.base_messages)
        may_fork = claim == _FORK or self._claims[claim] > 0
        if may_fork and self.max_branches is not None and len(self._branches) + self._reserved() >= self.max_branches:
            raise self._full()
        self._calls += 1
        self._pending[self._calls - 1] = claim
        self._claims[claim] += 1
        next_id = self._next_branch if draft.target is None else draft.target
        return Prepared(
            next_id, draft.prompt_token_ids, self._calls - 1, draft.reused_tokens, draft.source, draft.base_messages,
            draft.keys, draft.tools_key, draft.reason, draft.text, draft.kwargs_key,
        )  # fmt: skip

    def release(self, prepared: Prepared) -> None:
        """Give back the reservation of a prepared turn that will not be committed (no-op after `commit`)."""
        claim = self._pending.pop(prepared.turn_index, None)
        if claim is not None:
            self._claims[claim] -= 1
            if not self._claims[claim]:
                del self._claims[claim]

    def _reserved(self) -> int:
        """Branches that calls in flight will create: every fork, and on each branch being extended all
        calls but one while it is still unextended (once one committed, every other one forks)."""
        reserved = 0
        for (branch_id, base), count in self._claims.items():
            if (branch_id, base) == _FORK:
                reserved += count
            else:
                reserved += count - 1 if len(self._branches[branch_id].messages) == base else count
        return reserved

    def _full(self) -> ConversationError:
        return ConversationError(
            f"this rollout already has {len(self._branches)} branches and {self._reserved()} more in flight "
            f"(max_branches {self.max_branches}); rewriting earlier messages, or calls on the same messages at once, start new ones"
        )

    def commit(self, prepared: Prepared, completion_token_ids: Sequence[int], assistant_message: Mapping) -> int:
        """Record a finished turn: its completion tokens and the assistant message the gateway returned
        (what the agent will echo back). Returns the branch id the turn landed on. `ConversationError`
        (nothing recorded) when it would create a branch past `max_branches`.
        """
        self.release(prepared)
        (assistant,) = to_template_messages([assistant_message])
        messages = [*prepared._messages, message_key(assistant)]
        tokens = list(prepared.prompt_token_ids) + list(completion_token_ids)
        source = self._branches.get(prepared._source) if prepared._source is not None else None
        # Every commit adds a message, so an unchanged length means nobody extended the branch meanwhile.
        if source is not None and prepared._base_messages == len(source.messages):
            target = source
        else:
            if self.max_branches is not None and len(self._branches) >= self.max_branches:
                raise self._full()
            reason = prepared._fork_reason if prepared.branch_id != getattr(source, "id", None) else "concurrent"
            inherited = {n: t for n, t in source.marks.items() if n <= prepared._base_messages} if source else {}
            text_marks = {n: c for n, c in source.text_marks.items() if n in inherited} if source else {}
            unclosed = {n for n in source.unclosed if n in inherited} if source else set()
            kwargs_marks = {n: c for n, c in source.kwargs_marks.items() if n in inherited} if source else {}
            target = Branch(
                self._next_branch, [], [], inherited, prepared._tools_key, prepared._source, reason,
                text_marks=text_marks, unclosed=unclosed, kwargs_marks=kwargs_marks,
            )  # fmt: skip
            self._branches[target.id] = target
            self._next_branch += 1
        target.token_ids, target.messages = tokens, messages
        target.marks[len(messages)] = len(tokens)
        kwargs_key = prepared._kwargs_key
        reused = target.kwargs_marks.get(prepared._base_messages, "") if prepared.reused_tokens else kwargs_key
        if kwargs_key or reused:
            target.kwargs_marks[len(messages)] = kwargs_key if reused == kwargs_key else _MIXED
        if prepared._text is None:
            target.text, target.text_marks = None, {}
        else:
            target.text = prepared._text + self.template.decode(completion_token_ids)
            target.text_marks[len(messages)] = len(target.text)
            if not completion_token_ids or completion_token_ids[-1] != getattr(self.tokenizer, "eos_token_id", None):
                target.unclosed.add(len(messages))
        target.turns += 1
        return target.id

    def _longest_match(self, keys: tuple[MessageKey, ...], tools_key: str) -> tuple[Branch | None, int]:
        """The branch and mark k with M[:k] recorded on it, k as large as possible; extending a branch
        beats forking one at the same k, then the oldest branch wins (deterministic)."""
        best, best_rank = None, (0, False)
        for branch in self._branches.values():
            if branch.tools_key != tools_key:
                continue
            common = 0
            for recorded, wanted in zip(branch.messages, keys, strict=False):  # the common prefix
                if recorded != wanted and not _echo_without_reasoning(recorded, wanted):
                    break
                common += 1
            k = max((n for n in branch.marks if n <= common), default=0)
            rank = (k, k == len(branch.messages))
            if k and rank > best_rank:
                best, best_rank = branch, rank
        return best, best_rank[0]


def _echo_without_reasoning(recorded: MessageKey, wanted: MessageKey) -> bool:
    """A reply echoed back without the reasoning it was sampled with: the same turn. Agents (the OpenAI
    Agents SDK among them) drop fields they do not know; the turn's sampled tokens, reasoning included,
    stay the prompt, as a template that keeps reasoning would render it. An echo with other reasoning
    is a rewrite."""
    return len(recorded) == 4 and len(wanted) == 3 and recorded[:3] == wanted


def _restore_reasoning(
    msgs: list[dict], keys: tuple[MessageKey, ...], recorded: list[MessageKey], k: int
) -> tuple[list[dict], tuple[MessageKey, ...]]:
    """The first k messages with the reasoning that echoes dropped put back from the record, so the
    template renders the turns as they were sampled (a template like Qwen3's renders an assistant turn
    without reasoning differently when it is last, so the sampled text would not prefix the render)."""
    msgs, keys_out = list(msgs), list(keys)
    for i in range(k):
        if keys_out[i] != recorded[i]:  # `_echo_without_reasoning`: all `_longest_match` lets through
            reasoning = recorded[i][-1]  # the recorded key is (role, text, calls, reasoning)
            msgs[i] = {"thinking": reasoning, **msgs[i], "reasoning_content": reasoning}  # as toolcalls writes it
            keys_out[i] = recorded[i]
    return msgs, tuple(keys_out)


def _chars(message: Mapping) -> int:
    """Characters a template-form message renders (content, reasoning, tool-call names and arguments)."""
    size = len(message["content"]) + len(message.get("reasoning_content") or "")
    for call in message.get("tool_calls") or ():
        function = call["function"]
        size += len(function["name"]) + sum(len(k) + _value_chars(v) for k, v in function["arguments"].items())
    return size


def _value_chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
