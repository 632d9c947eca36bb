"""The gateway's core, without HTTP: rollouts by API key, and the path of every generation call.

    key -> rollout -> render (token-exact, `conversation`) -> route + generate (`pool`)
        -> parse tool calls -> commit the turn to the conversation -> record the Turn in the store

A rollout key is `rk-<rollout id>.<HMAC of the id>`, so any gateway that shares the secret can check
a key without a lookup, and after a restart a key still finds its rollout in the store (its next
turn then starts a fresh branch, which sample assembly handles as a fork). Store calls run on a
small thread pool: SQLite and Redis clients block.

Every turn records the sampling options it was drawn with (temperature, top-p, top-k), and the
learner scores its tokens at them. With `gateway.sampling_overrides: refuse` (the default) a request
may not ask for other options than the run's `rollout.sampling`: it gets a 400 naming the option.

Scoring (`score_tokens`, prefill-only log-probs of given token sequences) needs no key and records
nothing: it is a read of the engines' current weights, not a turn of a rollout.

An evaluation rollout (opened with `evaluation: true`, for held-out evaluation) takes the same path
but is sampled greedily whatever the request asks, and touches no store: it lives in `_live` until
it is finished or aborted, then only its ended status is remembered. It never reaches the learner.

Text is text (`template`): message content, tool results, tool-call arguments and text prompts are
encoded as plain tokens, markers come only from the chat template; a `/v1/completions` text prompt is
raw text too (send token ids for a prompt with special tokens). A stop string is matched against what
the model writes: a marker token writes exactly its text, so `stop="<|user|>"` stops at that token.

Bounded work before validation: every message's characters (and a text prompt's) are checked against
`gateway.max_message_chars` before anything is rendered or tokenized, and a prompt with more than
OFFLOAD_CHARS characters of new text is rendered and tokenized on a worker thread (`offload`), so one big request
does not hold up the others' event loop. A rollout's conversation is prepared and committed under
its own lock (uncontended, it does not yield), so the thread never races a commit.

Per-rollout limits hold under concurrent calls on one key: branches (`conversation`), and turns and
sampled tokens (`budget`: each call holds a turn and its max_tokens from before it is rendered until it
is recorded or refused), each refused with a 400 naming its gateway.* key.

A chat call runs in phases that the plain, streamed (`streaming`) and Anthropic (`anthropic_route`)
routes share, so all three record the same turn for the same request: `begin_chat` (rollout, sampling
fitted to the context, budget, exact prompt), then `generate` or `stream`, then `end_chat` (parse,
commit, record), or `drop`. A stream whose caller leaves before the result (the client disconnected)
aborts the engine request and records the turn truncated: the tokens sampled so far, finish reason
"abort"; sample assembly trains on them like any turn's.

Nothing here knows HTTP; `app.py` maps the exceptions raised here to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.records import GenerationResult, SamplingParams, TokenDelta, Turn

from . import api
from .auth import Credentials
from .budget import Reservation, RolloutBudget, RolloutLimit
from .conversation import Conversation, ConversationError, Prepared
from .offload import CpuWorkers
from .parsers import ParserNotFound, parse_reply, reasoning_parser, tool_call_parser
from .parsers.auto import resolve as resolve_parser
from .pool import EnginePool
from .store import RolloutClosed, SQLiteStore, StoreError, TrajectoryRecorder, UnknownRollout
from .template import chat_template
from .toolcalls import REASONING_FIELDS, MessageError, ParsedCompletion

log = logging.getLogger(__name__)

TEXT_HISTORY = 8
"""Text-completion turns per rollout whose exact tokens a later prompt may reuse."""
OFFLOAD_CHARS = 8192
"""New prompt text (characters) above which rendering and tokenizing run on a worker thread: encoding
takes ~0.4 µs a character on a busy core, so this keeps the event loop's stalls to a few ms."""
OFFLOAD_RENDER_CHARS = 32 * OFFLOAD_CHARS
"""Conversation size (characters) above which even the render alone (every turn renders it all) goes to the thread."""
MAX_STOPS = 64
"""Stop strings in one request (each is tokenized on the event loop)."""
MAX_STOP_CHARS = 1024
"""Longest stop string considered (longer ones cannot be one token)."""


class GatewayError(Exception):
    """A refusal with an HTTP status and an OpenAI-style error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def bad_request(message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message)


@dataclass(eq=False)
class Rollout:
    id: str
    conversation: Conversation
    budget: RolloutBudget
    """Its turns and sampled tokens against gateway.max_rollout_turns and max_rollout_tokens."""
    texts: list[tuple[str, list[int]]] = field(default_factory=list)
    """(text, its exact tokens) of recent text-completion turns, prompt plus completion."""
    abandon: set[asyncio.Future] = field(default_factory=set)
    """Wake-ups of this rollout's requests in flight; resolved when the rollout ends."""
    broken: str | None = None
    evaluation: api.OpenRolloutRequest | None = None
    """An evaluation rollout's opening request (its task, group and metadata); None for a recorded rollout."""
    turns: int = 0
    """Turns an evaluation rollout has taken (the store counts a recorded rollout's)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held while the conversation prepares or commits a turn (preparing may run on a worker thread)."""


@dataclass(eq=False)
class _Turn:
    rollout: Rollout
    sampling: SamplingParams
    """What it samples with: the request's options, max_tokens fitted to the context (`_fit`)."""
    reservation: Reservation
    started: float
    """perf_counter() when the call arrived (the record's gateway_s counts from here)."""


@dataclass(eq=False)
class ChatTurn(_Turn):
    """A chat call between its prompt and its record: what the plain, streamed and Anthropic routes share."""

    prepared: Prepared | None = None
    tools: list | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        assert self.prepared is not None
        return self.prepared.prompt_token_ids

    @property
    def reused_tokens(self) -> int:
        assert self.prepared is not None
        return self.prepared.reused_tokens


@dataclass(eq=False)
class TextTurn(_Turn):
    """A text completion between its prompt and its record."""

    text: str | None = None
    """The prompt text (None: the prompt was token ids)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    reused_tokens: int = 0


class GatewayService:
    def __init__(
        self,
        store: TrajectoryRecorder,
        tokenizer: Any,
        pool: EnginePool,
        config: GatewayConfig,
        sampling: SamplingConfig,
        *,
        secret: bytes | None = None,
        model_name: str = "asyncrl-policy",
        io_threads: int | None = None,
    ) -> None:
        self.store, self.tokenizer, self.pool = store, tokenizer, pool
        self.config, self.sampling, self.model_name = config, sampling, model_name
        self.template = chat_template(tokenizer)
        try:
            tool_name = resolve_parser(config.tool_parser, tokenizer, "tool") or config.tool_parser
            reasoning_name = resolve_parser(config.reasoning_parser, tokenizer, "reasoning")
            self.tool_parser = tool_call_parser(tool_name)
            self.reasoning_parser = reasoning_parser(reasoning_name) if reasoning_name else None
        except ParserNotFound as error:
            raise ValueError(f"gateway: {error}") from None
        self._secret = secret or secrets.token_bytes(32)
        self.credentials = Credentials.from_secret(self._secret)
        """The run token (lifecycle, scoring) and the engine token (registration) of this gateway."""
        self._live: dict[str, Rollout] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        # SQLite takes one writer at a time, and a writer that finds the lock taken sleeps in
        # growing steps (up to 100 ms): one thread queues writes instead. Redis takes them in parallel.
        io_threads = io_threads or (1 if isinstance(store, SQLiteStore) else 4)
        self._io_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="gateway-store")
        # Tool-call ids need to be unique, not secret; uuid4 reads the OS entropy pool on every
        # call, which took 0.2 ms a call on a busy machine.
        ids = random.Random(secrets.randbits(128))
        self._call_id = lambda: f"call_{ids.getrandbits(96):024x}"
        self.in_flight = 0
        self._cpu = CpuWorkers()
        """Where big prompts are rendered and tokenized; a stop signal does not wait for them."""
        self._background: set[asyncio.Task] = set()
        """Turns of streams being recorded, which the client leaving must not cancel."""

    def close(self) -> None:
        self._cpu.close()
        self._io_pool.shutdown(wait=True)

    async def _io(self, fn, *args, **kwargs):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._io_pool, functools.partial(fn, *args, **kwargs))
        except StoreError:
            raise
        except Exception as error:  # the store's connection or disk, not the request
            raise GatewayError(503, "store_unavailable", f"trajectory store failed: {type(error).__name__}: {error}") from error

    # --- lifecycle ----------------------------------------------------------------------------

    async def open_rollout(self, request: api.OpenRolloutRequest) -> api.OpenRolloutResponse:
        if request.evaluation:
            rollout_id = f"eval-{secrets.token_hex(12)}"
            self._live[rollout_id] = self._new_rollout(rollout_id)
            self._live[rollout_id].evaluation = request
        else:
            rollout_id = await self._io(self.store.open, request.task, request.group_id, request.metadata)
            self._live[rollout_id] = self._new_rollout(rollout_id)
        return api.OpenRolloutResponse(rollout_id=rollout_id, api_key=self._key(rollout_id))

    async def finish_rollout(self, rollout_id: str, request: api.FinishRolloutRequest) -> api.RolloutInfo:
        evaluation = self._evaluation(rollout_id)
        if evaluation is not None:
            info = _evaluation_info(evaluation, request.status, request.reward, request.metrics, request.reason)
            self._end(rollout_id, request.status)
            return info
        await self._io(self.store.finish, rollout_id, request.reward, request.status, request.metrics, request.reason)
        self._end(rollout_id, request.status)
        return await self.rollout_info(rollout_id)

    async def abort_rollout(self, rollout_id: str, request: api.AbortRolloutRequest) -> api.RolloutInfo:
        evaluation = self._evaluation(rollout_id)
        if evaluation is not None:
            info = _evaluation_info(evaluation, "aborted", None, {}, request.reason)
            self._end(rollout_id, "aborted")
            return info
        await self._io(self.store.abort, rollout_id, request.reason)
        self._end(rollout_id, "aborted")
        return await self.rollout_info(rollout_id)

    def _evaluation(self, rollout_id: str) -> Rollout | None:
        """The running evaluation rollout of this id (None: a recorded rollout, or one that ended)."""
        rollout = self._live.get(rollout_id)
        return rollout if rollout is not None and rollout.evaluation is not None else None

    async def rollout_info(self, rollout_id: str) -> api.RolloutInfo:
        evaluation = self._evaluation(rollout_id)
        if evaluation is not None:
            return _evaluation_info(evaluation, "running", None, {}, "")
        t = await self._io(self.store.get, rollout_id)
        live = self._live.get(rollout_id)
        return api.RolloutInfo(
            rollout_id=t.rollout_id, task=t.task, group_id=t.group_id, metadata=t.metadata, status=t.status,
            reward=t.reward, metrics=t.metrics, reason=t.reason, turns=len(t.turns),
            in_flight=len(live.abandon) if live else 0,
        )  # fmt: skip

    def _end(self, rollout_id: str, status: str | None) -> None:
        """Forget a rollout that ended (status None: ended elsewhere, ask the store next time)."""
        rollout = self._live.pop(rollout_id, None)
        if status is not None:
            self._ended[rollout_id] = status
            while len(self._ended) > self.config.max_ended_rollouts:
                self._ended.popitem(last=False)
        for wake in list(rollout.abandon if rollout else ()):
            if not wake.done():
                wake.set_result(f"rollout {rollout_id} was {status or 'ended'} while this request was running; nothing was recorded")

    def _new_rollout(self, rollout_id: str, recorded: Sequence[Turn] = ()) -> Rollout:
        """A rollout's in-memory state; `recorded`: its turns in the store (one a restarted gateway picks up)."""
        conversation = Conversation(self.tokenizer, max_branches=self.config.max_branches, template=self.template)
        budget = RolloutBudget(self.config.max_rollout_turns, self.config.max_rollout_tokens).resume(recorded)
        return Rollout(rollout_id, conversation, budget)

    def _key(self, rollout_id: str) -> str:
        return f"rk-{rollout_id}.{self._mac(rollout_id)}"

    def _mac(self, rollout_id: str) -> str:
        return hmac.new(self._secret, rollout_id.encode(), hashlib.sha256).hexdigest()[:32]

    async def rollout_for_key(self, key: str | None) -> Rollout:
        """The running rollout a key stands for; 401 for a key this gateway never issued, 409 for an ended rollout."""
        if not key:
            raise GatewayError(
                401, "missing_api_key", "send the rollout key as `Authorization: Bearer <api_key>` (open a rollout with POST /rollouts)"
            )
        rollout_id, _, mac = key.removeprefix("rk-").rpartition(".")
        # Bytes: compare_digest refuses a str that is not ASCII, and a header may carry anything.
        forged = not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), self._mac(rollout_id).encode())
        if not key.startswith("rk-") or not rollout_id or forged:
            raise GatewayError(401, "invalid_api_key", "unknown rollout key (open a rollout with POST /rollouts and use its api_key)")
        rollout = self._live.get(rollout_id)
        if rollout is not None:
            if rollout.broken:
                raise GatewayError(409, "rollout_broken", f"rollout {rollout_id} cannot continue: {rollout.broken}; abort it")
            return rollout
        status = self._ended.get(rollout_id)
        if status is None:  # issued before a restart, or ended long ago: the store knows
            try:
                stored = await self._io(self.store.get, rollout_id)
            except UnknownRollout:
                raise GatewayError(401, "invalid_api_key", f"rollout {rollout_id} is not in this gateway's store") from None
            status = stored.status
            if status == "running":
                return self._live.setdefault(rollout_id, self._new_rollout(rollout_id, stored.turns))
        raise GatewayError(409, "rollout_closed", f"rollout {rollout_id} is {status}; it takes no more calls")

    # --- generation ---------------------------------------------------------------------------

    async def chat(self, key: str | None, request: api.ChatCompletionRequest) -> dict:
        """A whole chat completion (`stream` is the HTTP layer's business: `streaming.chat_events`)."""
        turn = await self.begin_chat(key, request)
        result, timings = await self.generate(turn)
        index, branch, parsed = await self.end_chat(turn, result, timings)
        logprobs = self._token_logprobs(result) if request.logprobs else None
        return api.chat_response(
            self.model_name, turn.rollout.id, index, branch, parsed.message(), parsed.finish_reason(result.finish_reason),
            result, len(turn.prompt_token_ids), turn.reused_tokens, logprobs, turn.rollout.evaluation is not None,
        )  # fmt: skip

    async def begin_chat(self, key: str | None, request: api.ChatCompletionRequest) -> ChatTurn:
        """Everything before a chat call samples: its rollout, sampling options, budget and exact prompt.
        The turn must then reach `end_chat` or `drop` (`generate` and `stream` drop it themselves when they fail)."""
        started = time.perf_counter()
        rollout = await self.rollout_for_key(key)
        if len(request.messages) > self.config.max_messages:
            raise bad_request(f"{len(request.messages)} messages; gateway.max_messages is {self.config.max_messages}")
        if isinstance(request.tool_choice, dict) or request.tool_choice == "required":
            raise bad_request("tool_choice that forces a tool is not supported (the policy decides); use auto or none")
        sampling = self._sampling(request, request.max_completion_tokens or request.max_tokens)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        for i, message in enumerate(messages):
            self._check_chars(f"messages[{i}]", _message_chars(message))
        template_kwargs = _template_kwargs(request)
        reservation = self._reserve(rollout, sampling.max_tokens)
        try:
            async with rollout.lock:
                prepared = await self._prepare(rollout.conversation, messages, request.tools, template_kwargs)
        except BaseException:
            rollout.budget.release(reservation)
            raise
        turn = ChatTurn(rollout, sampling, reservation, started, prepared, request.tools)
        try:
            turn.sampling = self._fit(sampling, len(prepared.prompt_token_ids))
        except BaseException:
            self.drop(turn)
            raise
        return turn

    async def end_chat(self, turn: ChatTurn, result: GenerationResult, timings: dict) -> tuple[int, int, ParsedCompletion]:
        """(turn index, branch, parsed reply) of a chat call that sampled `result`: the reply is parsed,
        committed to the conversation and recorded. Past max_branches the commit is refused and nothing
        is recorded."""
        rollout, prepared = turn.rollout, turn.prepared
        assert prepared is not None
        try:
            parsed = self.parse(result.token_ids, turn.tools)
            async with rollout.lock:
                branch = rollout.conversation.commit(prepared, result.token_ids, parsed.message())
            turn.reservation.spend(len(result.token_ids))
        finally:
            self.drop(turn)
        index = await self._record(rollout, prepared.prompt_token_ids, result, turn.sampling, branch, timings, turn.started)
        return index, branch, parsed

    async def count_prompt_tokens(self, key: str | None, request: api.ChatCompletionRequest) -> int:
        """The prompt tokens a chat call with these messages would send now: rendered on the rollout's
        conversation, as `begin_chat` would, with nothing reserved, sampled or recorded."""
        rollout = await self.rollout_for_key(key)
        if len(request.messages) > self.config.max_messages:
            raise bad_request(f"{len(request.messages)} messages; gateway.max_messages is {self.config.max_messages}")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        for i, message in enumerate(messages):
            self._check_chars(f"messages[{i}]", _message_chars(message))
        conversation = rollout.conversation
        async with rollout.lock:
            plan = _refusing(conversation.plan, messages, request.tools, _template_kwargs(request))
            if plan.new_chars > OFFLOAD_CHARS or plan.chars > OFFLOAD_RENDER_CHARS:
                draft = await self._cpu.run(_refusing, conversation.render, plan)
            else:
                draft = _refusing(conversation.render, plan)
        return len(draft.prompt_token_ids)

    def parse(self, token_ids: Sequence[int], tools: list | None) -> ParsedCompletion:
        """A reply's content, reasoning and tool calls, read by this gateway's parsers."""
        return parse_reply(token_ids, self.tokenizer, tools, self._call_id, self.tool_parser, self.reasoning_parser)

    def drop(self, turn: ChatTurn | TextTurn) -> None:
        """Give back what a turn holds (its branch reservation, its budget); harmless after `end_chat`."""
        if isinstance(turn, ChatTurn) and turn.prepared is not None:
            turn.rollout.conversation.release(turn.prepared)
        turn.rollout.budget.release(turn.reservation)

    async def complete(self, key: str | None, request: api.CompletionRequest) -> dict:
        turn = await self.begin_text(key, request)
        result, timings = await self.generate(turn)
        index, text = await self.end_text(turn, result, timings)
        logprobs = self._token_logprobs(result) if request.logprobs is not None else None
        return api.completion_response(
            self.model_name, turn.rollout.id, index, text, result, len(turn.prompt_token_ids), turn.reused_tokens, logprobs,
            turn.rollout.evaluation is not None,
        )  # fmt: skip

    async def begin_text(self, key: str | None, request: api.CompletionRequest) -> TextTurn:
        """Everything before a text completion samples; then `end_text` or `drop`, as for `begin_chat`."""
        started = time.perf_counter()
        rollout = await self.rollout_for_key(key)
        if request.echo or request.suffix:
            raise bad_request("echo and suffix are not supported")
        sampling = self._sampling(request, request.max_tokens)
        reservation = self._reserve(rollout, sampling.max_tokens)
        turn = TextTurn(rollout, sampling, reservation, started)
        try:
            turn.text, turn.prompt_token_ids, turn.reused_tokens = await self._text_prompt(rollout, request.prompt)
            turn.sampling = self._fit(sampling, len(turn.prompt_token_ids))
        except BaseException:
            self.drop(turn)
            raise
        return turn

    async def end_text(self, turn: TextTurn, result: GenerationResult, timings: dict) -> tuple[int, str]:
        """(turn index, completion text) of a text completion that sampled `result`, recorded."""
        rollout = turn.rollout
        turn.reservation.spend(len(result.token_ids))
        self.drop(turn)
        completion = _strip_eos(result.token_ids, self.tokenizer)
        completion_text = self.tokenizer.decode(completion, skip_special_tokens=False)
        if turn.text is not None:
            rollout.texts = ([*rollout.texts, (turn.text + completion_text, turn.prompt_token_ids + completion)])[-TEXT_HISTORY:]
        index = await self._record(rollout, turn.prompt_token_ids, result, turn.sampling, 0, timings, turn.started)
        return index, completion_text

    async def generate_tokens(self, key: str | None, request: api.TokenGenerateRequest) -> api.TokenGenerateResponse:
        started = time.perf_counter()
        rollout = await self.rollout_for_key(key)
        sampling = self._sampling(request, request.max_tokens)
        with self._budgeted(rollout, sampling.max_tokens) as reservation:
            result, timings = await self._generate(rollout, request.prompt_token_ids, sampling)
            reservation.spend(len(result.token_ids))
        index = await self._record(rollout, request.prompt_token_ids, result, sampling, 0, timings, started)
        return api.TokenGenerateResponse(
            rollout_id=rollout.id, turn_index=index, token_ids=result.token_ids, logprobs=result.logprobs,
            versions=result.versions, finish_reason=result.finish_reason, engine_id=result.engine_id,
        )  # fmt: skip

    async def score_tokens(self, request: api.TokenScoreRequest) -> api.TokenScoreResponse:
        """Prefill-only log-probs from the least loaded engine; no rollout, nothing recorded."""
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        self.in_flight += 1
        try:
            result, _ = await self.pool.score(request.sequences, request.temperature, deadline=deadline)
        finally:
            self.in_flight -= 1
        return api.TokenScoreResponse(logprobs=result.logprobs, engine_id=result.engine_id, version=result.version)

    def _sampling(self, request: Any, max_tokens: int | None) -> SamplingParams:
        if (getattr(request, "n", None) or 1) != 1:
            raise bad_request("n must be 1; send n requests (each is recorded as its own turn)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name, None):
                raise bad_request(f"{name} is not supported: recorded log-probs must come from the policy's own distribution")
        defaults, cap = self.sampling, self.config.max_tokens
        max_tokens = max_tokens or min(defaults.max_tokens, cap)
        if max_tokens > cap:
            if self.config.max_tokens_fit != "clamp":
                raise bad_request(f"max_tokens {max_tokens} exceeds gateway.max_tokens {cap} (gateway.max_tokens_fit is refuse)")
            max_tokens = cap
        stop = getattr(request, "stop", None)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > MAX_STOPS:
            raise bad_request(f"{len(stops)} stop strings; at most {MAX_STOPS} (or send stop_token_ids)")
        pick = lambda value, default: default if value is None else value  # noqa: E731
        params = SamplingParams(
            temperature=pick(request.temperature, defaults.temperature), top_p=pick(request.top_p, defaults.top_p),
            top_k=pick(request.top_k, defaults.top_k), max_tokens=max_tokens, seed=request.seed,
            stop_token_ids=tuple(request.stop_token_ids or ()) + tuple(self.stop_token(s) for s in stops),
        )  # fmt: skip
        params.validate()  # a RequestError, answered as a 400
        refuse = self.config.sampling_overrides == "refuse"
        if refuse and (params.temperature, params.top_p, params.top_k) != (defaults.temperature, defaults.top_p, defaults.top_k):
            raise _override_refused(params, defaults)
        return params

    def stop_token(self, text: str) -> int:
        """The token a stop string stands for; a 400 unless it is exactly one token."""
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"stop string of {len(text)} characters; only single-token stops are supported (or send stop_token_ids)")
        marker = self.template.marker_id(text)
        ids = [marker] if marker is not None else self.template.encode_text(text)
        if len(ids) != 1:
            raise bad_request(f"stop string {text!r} is {len(ids)} tokens; only single-token stops are supported (or send stop_token_ids)")
        return ids[0]

    async def _text_prompt(self, rollout: Rollout, prompt: Any) -> tuple[str | None, list[int], int]:
        """(text or None, exact prompt tokens, tokens reused): a text prompt that extends an earlier
        turn's text reuses that turn's exact tokens and encodes only the rest, as plain text."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), 0
        if not isinstance(prompt, str):
            raise bad_request("prompt must be one string or one list of token ids (one prompt per request)")
        if not prompt:
            raise bad_request("prompt is empty")
        self._check_chars("prompt", len(prompt))
        base_text, base = max(((t, ids) for t, ids in rollout.texts if prompt.startswith(t)), key=lambda e: len(e[0]), default=("", []))
        rest = prompt[len(base_text) :]
        if len(rest) > OFFLOAD_CHARS:
            return prompt, base + await self._cpu.run(self.template.encode_text, rest), len(base)
        return prompt, base + self.template.encode_text(rest), len(base)

    def _check_chars(self, what: str, chars: int) -> None:
        if chars > self.config.max_message_chars:
            raise bad_request(f"{what} has {chars} characters; gateway.max_message_chars is {self.config.max_message_chars}")

    async def _prepare(self, conversation: Conversation, messages: list[dict], tools: list | None, template_kwargs: dict) -> Prepared:
        """The turn's prompt, rendered and tokenized on a worker thread when it is big (the caller holds the rollout's lock)."""
        plan = _refusing(conversation.plan, messages, tools, template_kwargs)
        if plan.new_chars > OFFLOAD_CHARS or plan.chars > OFFLOAD_RENDER_CHARS:
            draft = await self._cpu.run(_refusing, conversation.render, plan)
        else:
            draft = _refusing(conversation.render, plan)
        return conversation.admit(draft)

    def _reserve(self, rollout: Rollout, max_tokens: int) -> Reservation:
        """A call's hold on its rollout's turns and tokens, taken before any work; given back by `drop`."""
        try:
            return rollout.budget.reserve(max_tokens)
        except RolloutLimit as limit:
            raise GatewayError(400, limit.code, str(limit)) from None

    @contextlib.contextmanager
    def _budgeted(self, rollout: Rollout, max_tokens: int) -> Iterator[Reservation]:
        reservation = self._reserve(rollout, max_tokens)
        try:
            yield reservation
        finally:
            rollout.budget.release(reservation)

    def _fit(self, sampling: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """gateway.max_tokens_fit=clamp: a max_tokens past what the engines' context leaves after the prompt is
        cut to fit (agent harnesses ask for far more than a small policy's context); refuse: the engine says no.
        A prompt past gateway.max_prompt_tokens is refused here first, naming that limit."""
        if prompt_tokens > self.config.max_prompt_tokens:
            raise bad_request(f"prompt is {prompt_tokens} tokens; gateway.max_prompt_tokens is {self.config.max_prompt_tokens}")
        context = self.pool.context_tokens()
        if self.config.max_tokens_fit != "clamp" or context is None or prompt_tokens + sampling.max_tokens <= context:
            return sampling
        room = context - prompt_tokens
        if room < 1:
            raise bad_request(f"prompt is {prompt_tokens} tokens; the engines' context is {context} tokens, which leaves no room to sample")
        return dataclasses.replace(sampling, max_tokens=room)

    async def generate(self, turn: ChatTurn | TextTurn) -> tuple[GenerationResult, dict]:
        """Sample a turn's completion whole (result, timings); a failure drops the turn."""
        try:
            return await self._generate(turn.rollout, turn.prompt_token_ids, turn.sampling)
        except BaseException:
            self.drop(turn)
            raise

    async def stream(self, turn: ChatTurn | TextTurn) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Sample a turn's completion as it comes: TokenDeltas, then the whole GenerationResult (whose
        timings hold the gateway's too); the caller then ends the turn (`end_chat` / `end_text`). A failure
        drops the turn. A caller that leaves before the result (`aclose`, or its task cancelled: the client
        disconnected) aborts the engine request, and the turn is recorded truncated: the tokens sampled so
        far, finish reason "abort" (`_keep_truncated`, on a task of its own, since the caller's is ending)."""
        rollout, sampling = turn.rollout, turn.sampling
        if len(turn.prompt_token_ids) > self.config.max_prompt_tokens:
            self.drop(turn)
            tokens, cap = len(turn.prompt_token_ids), self.config.max_prompt_tokens
            raise bad_request(f"prompt is {tokens} tokens; gateway.max_prompt_tokens is {cap}")
        if rollout.evaluation is not None:
            sampling = dataclasses.replace(sampling, temperature=0.0)
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        sampled = TokenDelta([], [], [])
        finished = False
        self.in_flight += 1
        try:
            engine = self.pool.stream(
                rollout.id, turn.prompt_token_ids, sampling, deadline=loop.time() + self.config.request_timeout_s, abandon=rollout.abandon
            )
            async with contextlib.aclosing(engine):
                async for item in engine:
                    if isinstance(item, GenerationResult):
                        finished = True
                        item.timings = {**item.timings, "engine_call_s": time.perf_counter() - began}
                    else:
                        sampled.token_ids += item.token_ids
                        sampled.logprobs += item.logprobs
                        sampled.versions += item.versions
                    yield item
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self._keep_truncated(turn, sampled, time.perf_counter() - began)
            raise
        except BaseException:
            self.drop(turn)
            raise
        finally:
            self.in_flight -= 1

    def _keep_truncated(self, turn: ChatTurn | TextTurn, sampled: TokenDelta, engine_s: float) -> None:
        """Record what a stream sampled before its caller left, on its own task; its errors are logged."""
        result = GenerationResult(
            "", list(turn.prompt_token_ids), sampled.token_ids, sampled.logprobs, sampled.versions, "abort", error="the client left"
        )
        timings = {"engine_call_s": engine_s}
        ending = self.end_chat(turn, result, timings) if isinstance(turn, ChatTurn) else self.end_text(turn, result, timings)

        async def keep() -> None:
            try:
                await ending
            except Exception as error:  # the rollout ended meanwhile, the store failed: nobody is left to tell
                log.warning("rollout %s: the truncated turn of a stream its client left was not recorded: %s", turn.rollout.id, error)

        self.background(keep())

    def background(self, coroutine) -> asyncio.Task:
        """Run `coroutine` on a task of its own, which outlives the request that started it (`settle` waits for it)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))
        return task

    async def settle(self) -> None:
        """Wait for the turns still being recorded on background tasks (streams whose clients left)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _generate(self, rollout: Rollout, prompt: list[int], sampling: SamplingParams) -> tuple[GenerationResult, dict]:
        if len(prompt) > self.config.max_prompt_tokens:
            raise bad_request(f"prompt is {len(prompt)} tokens; gateway.max_prompt_tokens is {self.config.max_prompt_tokens}")
        if rollout.evaluation is not None:
            sampling = dataclasses.replace(sampling, temperature=0.0)  # held-out evaluation decodes greedily
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        self.in_flight += 1
        try:
            result, retries = await self.pool.generate(
                rollout.id, prompt, sampling, deadline=loop.time() + self.config.request_timeout_s, abandon=rollout.abandon
            )
        finally:
            self.in_flight -= 1
        return result, {**result.timings, "engine_call_s": time.perf_counter() - began, "retries": float(retries)}

    async def _record(
        self, rollout: Rollout, prompt, result: GenerationResult, sampling: SamplingParams, branch: int, timings: dict, started: float
    ) -> int:
        if rollout.evaluation is not None:  # recorded nowhere, only counted
            rollout.turns += 1
            return rollout.turns - 1
        timings["gateway_s"] = time.perf_counter() - started
        turn = Turn(
            rollout.id, list(prompt), result.token_ids, result.logprobs, result.versions, result.finish_reason,
            branch=branch, engine_id=result.engine_id, timings=timings, created_at=time.time(),
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, routes=result.routes,
        )  # fmt: skip
        try:
            return await self._io(self.store.append, turn)
        except RolloutClosed:
            self._end(rollout.id, None)  # by another gateway, or by a call that raced this one
            raise
        except (StoreError, GatewayError) as error:
            # The conversation already holds this turn; a gap in the record must not pass silently.
            rollout.broken = f"turn could not be recorded ({error})"
            raise

    def _token_logprobs(self, result: GenerationResult) -> list[tuple[str, float]]:
        return [
            (self.tokenizer.decode([t], skip_special_tokens=False), lp) for t, lp in zip(result.token_ids, result.logprobs, strict=True)
        ]

    def health(self) -> dict:
        engines = self.pool.describe()
        return {
            "status": "ok" if engines else "no_engines",
            "engines": engines,
            "rollouts_running": len(self._live),
            "requests_in_flight": self.in_flight,
        }


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has it, or nobody is left to tell

    return done


def _refusing(step, *args):
    """A step of preparing the prompt; rendering problems are the request's fault, never a 500."""
    try:
        return step(*args)
    except (MessageError, ConversationError):
        raise
    except Exception as error:  # e.g. a template error on content the template cannot render
        raise bad_request(f"the messages cannot be rendered with the chat template: {type(error).__name__}: {error}") from None


def _template_kwargs(request: api.ChatCompletionRequest) -> dict:
    """What the request asks of the chat template beyond the messages (thinking switches)."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs


def _message_chars(message: dict) -> int:
    """Characters a request message (as dumped from the request) would have rendered: its text and tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        size = len(content)
    else:
        size = sum(len(p["text"]) for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str))
    size += sum(len(message[name]) for name in REASONING_FIELDS if isinstance(message.get(name), str))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        size += len(function.get("name") or "")
        if isinstance(arguments, str):
            size += len(arguments)
        elif isinstance(arguments, dict):
            size += sum(len(str(k)) + (len(v) if isinstance(v, str) else len(json.dumps(v))) for k, v in arguments.items())
    return size


def _evaluation_info(rollout: Rollout, status: str, reward: float | None, metrics: dict, reason: str) -> api.RolloutInfo:
    opened = rollout.evaluation
    assert opened is not None
    return api.RolloutInfo(
        rollout_id=rollout.id, task=opened.task, group_id=opened.group_id, metadata=opened.metadata, status=status,
        reward=reward, metrics=metrics, reason=reason, turns=rollout.turns, in_flight=len(rollout.abandon),
    )  # fmt: skip


def _override_refused(params: SamplingParams, run: SamplingConfig) -> GatewayError:
    """gateway.sampling_overrides=refuse: every call samples at the run's options, so every token is drawn
    from the distribution the run trains (the learner reproduces no top-k/top-p truncation)."""
    name = next(n for n in ("temperature", "top_p", "top_k") if getattr(params, n) != getattr(run, n))
    asked, value = getattr(params, name), getattr(run, name)
    return GatewayError(
        400, "sampling_override_refused",
        f"{name}={asked} differs from this run's rollout.sampling.{name}={value}, and gateway.sampling_overrides is "
        f"'refuse'; leave {name} out (or send {value}), or set gateway.sampling_overrides=allow to sample as each "
        "request asks (every turn records the options it was sampled with, and the learner scores it at them)",
    )  # fmt: skip


def _strip_eos(token_ids: list[int], tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return token_ids[:-1] if token_ids and token_ids[-1] == eos else list(token_ids)
