"""The gateway's core, without HTTP: the path of every generation call, from a rollout key to a recorded turn.

    key -> rollout (`rollouts`) -> sampling options (`sampling_policy`) -> render (token-exact,
        `conversation`, `turns`) -> route + generate (`pool`) -> parse tool calls -> commit the turn
        to the conversation -> record the Turn in the store

Store calls run on a small thread pool: SQLite and Redis clients block.

Scoring (`score_tokens`, prefill-only log-probs of given token sequences) needs no key and records
nothing: it is a read of the engines' current weights, not a turn of a rollout.

Per-rollout limits hold under concurrent calls on one key: branches (`conversation`), and turns and
sampled tokens (`budget`: each call holds a turn and its max_tokens from before it is rendered until it
is recorded or refused), each refused with a 400 naming its gateway.* key.

A chat call runs in phases that the plain, streamed (`streaming`) and Anthropic (`anthropic_route`)
routes share, so all three record the same turn for the same request: `begin_chat` (rollout, sampling
fitted to the context, budget, exact prompt), then `generate` or `stream`, then `end_chat` (parse,
commit, record), or `drop`. A stream whose caller leaves before the result (the client disconnected)
aborts the engine request and records the turn truncated: the tokens sampled so far, finish reason
"abort"; sample assembly trains on them like any turn's.

Nothing here knows HTTP; `app.py` maps the exceptions raised here (`errors.GatewayError`) to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.records import GenerationResult, SamplingParams, TokenDelta, Turn

from . import api
from .auth import Credentials
from .background import BackgroundTasks
from .engine_calls import EngineCalls
from .errors import GatewayError, bad_request
from .offload import CpuWorkers
from .parsers import ParserNotFound, parse_reply
from .parsers.auto import parsers_for
from .pool import EnginePool
from .replicas import ReplicaSet
from .rollouts import Rollout, RolloutTable
from .sampling_policy import SamplingPolicy
from .store import RolloutClosed, StoreError, TrajectoryRecorder
from .store_calls import store_calls
from .template import TokenizerTemplate, chat_template
from .toolcalls import ParsedCompletion
from .turns import ChatTurn, TextTurn, draft, remember_text, request_messages, strip_eos, template_kwargs, text_prompt

log = logging.getLogger(__name__)


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
        replicas: ReplicaSet | None = None,
    ) -> None:
        self.store, self.tokenizer, self.pool = store, tokenizer, pool
        self.config, self.sampling, self.model_name = config, sampling, model_name
        template = chat_template(tokenizer)
        try:
            self.tool_parser, self.reasoning_parser = parsers_for(config.tool_parser, config.reasoning_parser, tokenizer)
        except ParserNotFound as error:
            raise ValueError(f"gateway: {error}") from None
        self._secret = secret or secrets.token_bytes(32)
        self.credentials = Credentials.from_secret(self._secret)
        """The run token (lifecycle, scoring) and the engine token (registration) of this gateway."""
        self.replicas = replicas
        """This gateway's replicas (None: a lone gateway); `app.py` forwards calls on their rollouts to them."""
        self.rollouts = RolloutTable(store, self.io, tokenizer, template, config, self._secret, replicas)
        """The running rollouts, their keys, and the lifecycle calls (open, finish, abort, info)."""
        self.sampling_policy = SamplingPolicy(config, sampling, template, pool.context_tokens)
        self._template = template
        # SQLite takes one writer at a time, and a writer that finds the lock taken sleeps in
        # growing steps (up to 100 ms): one thread commits what queued up, together. Redis takes them in parallel.
        self._store_calls = store_calls(store, threads=io_threads or 4)
        # Tool-call ids need to be unique, not secret; uuid4 reads the OS entropy pool on every
        # call, which took 0.2 ms a call on a busy machine.
        ids = random.Random(secrets.randbits(128))
        self._call_id = lambda: f"call_{ids.getrandbits(96):024x}"
        self.calls = EngineCalls(pool, config)
        """Every call to the engines (whole, streamed, scoring), and how many are in flight."""
        self._cpu = CpuWorkers()
        """Where big prompts are rendered and tokenized; a stop signal does not wait for them."""
        self.background = BackgroundTasks()
        """Turns of streams being recorded, which the client leaving must not cancel."""

    @property
    def template(self) -> TokenizerTemplate:
        """The chat template that renders and encodes prompts and stop strings (every part reads this one)."""
        return self._template

    @template.setter
    def template(self, template: TokenizerTemplate) -> None:
        self._template = self.rollouts.template = self.sampling_policy.template = template

    def close(self) -> None:
        self._cpu.close()
        self._store_calls.close()

    async def io(self, fn, *args, **kwargs):
        try:
            return await self._store_calls(fn, *args, **kwargs)
        except StoreError:
            raise
        except Exception as error:  # the store's connection or disk, not the request
            raise GatewayError(503, "store_unavailable", f"trajectory store failed: {type(error).__name__}: {error}") from error

    def stop_token(self, text: str) -> int:
        """The token a stop string stands for; a 400 unless it is exactly one token."""
        return self.sampling_policy.stop_token(text)

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
        rollout = await self.rollouts.for_key(key)
        if len(request.messages) > self.config.max_messages:
            raise bad_request(f"{len(request.messages)} messages; gateway.max_messages is {self.config.max_messages}")
        if isinstance(request.tool_choice, dict) or request.tool_choice == "required":
            raise bad_request("tool_choice that forces a tool is not supported (the policy decides); use auto or none")
        sampling = self.sampling_policy.params(request, request.max_completion_tokens or request.max_tokens)
        messages = request_messages(request, self.config.max_message_chars)
        kwargs = template_kwargs(request)
        reservation = rollout.reserve(sampling.max_tokens)
        try:
            async with rollout.lock:
                prepared = rollout.conversation.admit(await draft(self._cpu, rollout.conversation, messages, request.tools, kwargs))
        except BaseException:
            rollout.budget.release(reservation)
            raise
        turn = ChatTurn(rollout, sampling, reservation, started, prepared, request.tools)
        try:
            turn.sampling = self.sampling_policy.fit(sampling, len(prepared.prompt_token_ids))
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
        rollout = await self.rollouts.for_key(key)
        if len(request.messages) > self.config.max_messages:
            raise bad_request(f"{len(request.messages)} messages; gateway.max_messages is {self.config.max_messages}")
        messages = request_messages(request, self.config.max_message_chars)
        async with rollout.lock:
            drafted = await draft(self._cpu, rollout.conversation, messages, request.tools, template_kwargs(request))
        return len(drafted.prompt_token_ids)

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
        rollout = await self.rollouts.for_key(key)
        if request.echo or request.suffix:
            raise bad_request("echo and suffix are not supported")
        sampling = self.sampling_policy.params(request, request.max_tokens)
        reservation = rollout.reserve(sampling.max_tokens)
        turn = TextTurn(rollout, sampling, reservation, started)
        try:
            turn.text, turn.prompt_token_ids, turn.reused_tokens = await text_prompt(
                self._cpu, self.template, rollout, request.prompt, self.config.max_message_chars
            )
            turn.sampling = self.sampling_policy.fit(sampling, len(turn.prompt_token_ids))
        except BaseException:
            self.drop(turn)
            raise
        return turn

    async def end_text(self, turn: TextTurn, result: GenerationResult, timings: dict) -> tuple[int, str]:
        """(turn index, completion text) of a text completion that sampled `result`, recorded."""
        rollout = turn.rollout
        turn.reservation.spend(len(result.token_ids))
        self.drop(turn)
        completion = strip_eos(result.token_ids, self.tokenizer)
        completion_text = self.tokenizer.decode(completion, skip_special_tokens=False)
        remember_text(rollout, turn, completion_text, completion)
        index = await self._record(rollout, turn.prompt_token_ids, result, turn.sampling, 0, timings, turn.started)
        return index, completion_text

    async def generate_tokens(self, key: str | None, request: api.TokenGenerateRequest) -> api.TokenGenerateResponse:
        started = time.perf_counter()
        rollout = await self.rollouts.for_key(key)
        sampling = self.sampling_policy.params(request, request.max_tokens)
        with rollout.budgeted(sampling.max_tokens) as reservation:
            result, timings = await self.calls.generate(rollout, request.prompt_token_ids, sampling)
            reservation.spend(len(result.token_ids))
        index = await self._record(rollout, request.prompt_token_ids, result, sampling, 0, timings, started)
        return api.TokenGenerateResponse(
            rollout_id=rollout.id, turn_index=index, token_ids=result.token_ids, logprobs=result.logprobs,
            versions=result.versions, finish_reason=result.finish_reason, engine_id=result.engine_id,
            kv_versions=result.kv_versions,
        )  # fmt: skip

    async def score_tokens(self, request: api.TokenScoreRequest) -> api.TokenScoreResponse:
        """Prefill-only log-probs from the least loaded engine; no rollout, nothing recorded."""
        result = await self.calls.score(request.sequences, request.temperature)
        return api.TokenScoreResponse(logprobs=result.logprobs, engine_id=result.engine_id, version=result.version)

    async def generate(self, turn: ChatTurn | TextTurn) -> tuple[GenerationResult, dict]:
        """Sample a turn's completion whole (result, timings); a failure drops the turn."""
        try:
            return await self.calls.generate(turn.rollout, turn.prompt_token_ids, turn.sampling)
        except BaseException:
            self.drop(turn)
            raise

    async def stream(self, turn: ChatTurn | TextTurn) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Sample a turn's completion as it comes: TokenDeltas, then the whole GenerationResult (whose
        timings hold the gateway's too); the caller then ends the turn (`end_chat` / `end_text`). A failure
        drops the turn. A caller that leaves before the result (`aclose`, or its task cancelled: the client
        disconnected) aborts the engine request, and the turn is recorded truncated: the tokens sampled so
        far, finish reason "abort" (`_keep_truncated`, on a task of its own, since the caller's is ending)."""
        began = time.perf_counter()
        sampled = TokenDelta([], [], [])
        finished = False
        try:
            async with contextlib.aclosing(self.calls.stream(turn.rollout, turn.prompt_token_ids, turn.sampling)) as engine:
                async for item in engine:
                    if isinstance(item, GenerationResult):
                        finished = True
                    else:
                        sampled.extend(item)
                        sampled.engine_id = item.engine_id
                    yield item
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self._keep_truncated(turn, sampled, time.perf_counter() - began)
            raise
        except BaseException:
            self.drop(turn)
            raise

    def _keep_truncated(self, turn: ChatTurn | TextTurn, sampled: TokenDelta, engine_s: float) -> None:
        """Record what a stream sampled before its caller left, on its own task; its errors are logged."""
        result = GenerationResult(
            "",
            list(turn.prompt_token_ids),
            sampled.token_ids,
            sampled.logprobs,
            sampled.versions,
            "abort",
            sampled.engine_id,
            error="the client left",
            kv_versions=sampled.kv_versions,
        )
        timings = {"engine_call_s": engine_s}
        ending = self.end_chat(turn, result, timings) if isinstance(turn, ChatTurn) else self.end_text(turn, result, timings)

        async def keep() -> None:
            try:
                await ending
            except Exception as error:  # the rollout ended meanwhile, the store failed: nobody is left to tell
                log.warning("rollout %s: the truncated turn of a stream its client left was not recorded: %s", turn.rollout.id, error)

        self.background.start(keep())

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
            kv_versions=result.kv_versions,
        )  # fmt: skip
        try:
            return await self.io(self.store.append, turn)
        except RolloutClosed:
            self.rollouts.end(rollout.id, None)  # by another gateway, or by a call that raced this one
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
            "rollouts_running": len(self.rollouts.live),
            "requests_in_flight": self.calls.in_flight,
            **(self.replicas.health() if self.replicas else {}),
        }
