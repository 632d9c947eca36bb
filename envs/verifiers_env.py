"""Environments of the `verifiers` library (`env: verifiers`): their rollouts, their rubrics, asyncrl's records.

A verifiers environment (`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv` and their subclasses) runs each
episode as it would anywhere: its own prompt formatting, turns, tool calls and stop conditions, its
rubric for the reward. The only difference is the client it is handed: the episode's OpenAI client,
bound to one rollout of the TITO gateway, so every call is recorded with its token IDs, log-probs and
policy version, and the learner trains on exactly what was sampled.

The environment is named as verifiers names it: an installed environment module (`environment:
wordle`, loaded by `verifiers.load_environment` with `environment_args`), or a factory by import
path (`environment: my_pkg.my_env:load_environment`). Tasks are the rows of its `dataset`; the
held-out split is its `eval_dataset` when it has one, else a stable hash of each row's prompt
(`heldout_fraction`), so the two splits never share a prompt.

Statuses: the rubric's reward for a rollout that ran (also when it stopped at a turn or token limit;
an empty reply, which verifiers counts as an error, is a sample worth 0);
`timeout` for one that hit the environment's `timeout_seconds`; `error` when the policy call failed
(the gateway refused it, a prompt longer than the model); `env_crash`, which the learner drops, when
the environment itself raised or recorded an error of its own (a tool that broke, a bug in
`env_response`). Rubrics with group-level reward functions need all of a group's rollouts at once,
which asyncrl's independent episodes are not; they are refused at start-up.

Tools of a `ToolEnv` run where verifiers runs them, in the episode runner's process, not in
asyncrl's sandbox: give untrusted tool code to an asyncrl environment with `needs_sandbox` instead.

This adapter targets the classic verifiers API (`verifiers.legacy` in 0.3, what `import verifiers as
vf` gives there); verifiers 0.4 removed it (its `v1` stack is a different contract) and requires an
openai client older than asyncrl's. Install with `pip install 'asyncrl[verifiers]'`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl.configs.context import EnvContext

from .base import EpisodeResult, EpisodeStatus, Split


class VerifiersError(ValueError):
    """The verifiers environment cannot be loaded or used; the message says which option or part."""


class VerifiersOptions(BaseModel):
    """The options of a `verifiers` task (`tasks.mix.<name>.options`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    environment: str = Field(min_length=1)
    """An installed verifiers environment id (loaded by `verifiers.load_environment`), or an import
    path 'package.module:factory' to a function returning a verifiers Environment."""
    environment_args: dict[str, Any] = {}
    """Keyword arguments of the environment's `load_environment`."""
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of the dataset's prompts held out (by a hash of the prompt) when the environment has no eval_dataset."""
    max_tokens: int | None = Field(None, ge=1)
    """Tokens per model call; None: the run's loop.episode_max_tokens."""
    model: str = "policy"
    """The model name the environment's calls carry (the gateway serves one policy whatever the name)."""


class VerifiersEnv:
    """A verifiers environment as an asyncrl task: rows as tasks, its rollout as the episode."""

    name = "verifiers"

    def __init__(self, options: VerifiersOptions, *, max_tokens: int = 16, temperature: float = 1.0) -> None:
        self.options = options
        self.max_tokens = options.max_tokens or max_tokens
        self.temperature = temperature
        self.vf_env = _load(options)
        if self.vf_env.requires_group_rollouts:
            raise VerifiersError(
                f"verifiers environment {options.environment!r}: its rubric has group-level reward functions, which "
                "score all of a group's rollouts together; asyncrl runs each rollout as its own episode (the learner "
                "forms the groups), so use individual reward functions"
            )
        self.train_rows, self.eval_rows = self._splits()
        # verifiers logs every empty reply as an aborted rollout; here it is an ordinary sample (see
        # _result), and a weak policy writes hundreds a minute, which would bury the run's display.
        self.vf_env.logger.addFilter(_not_an_empty_reply)

    @classmethod
    def from_config(cls, context: EnvContext, **options: Any) -> VerifiersEnv:
        """Options validated (errors name the key); the run's answer budget and sampling temperature."""
        try:
            parsed = VerifiersOptions(**options)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in error.errors())
            raise VerifiersError(f"verifiers options: {problems}") from None
        # The learner scores tokens at rollout.sampling.temperature; the calls must sample at the same one.
        return cls(parsed, max_tokens=context.episode_max_tokens, temperature=context.sampling.temperature)

    def sample_task(self, rng: random.Random, split: Split = "train") -> dict:
        rows = self.train_rows if split == "train" else self.eval_rows
        return dict(rows[rng.randrange(len(rows))])

    def heldout_tasks(self, num_problems: int, seed: int) -> list[dict]:
        """`num_problems` distinct held-out rows (a seeded sample without replacement)."""
        if num_problems > len(self.eval_rows):
            raise VerifiersError(
                f"verifiers environment {self.options.environment!r}: {num_problems} held-out problems asked for, its "
                f"held-out split has {len(self.eval_rows)} rows; lower the task's eval_problems or eval.num_problems"
            )
        return [dict(self.eval_rows[i]) for i in random.Random(seed).sample(range(len(self.eval_rows)), num_problems)]

    async def run_episode(self, task: dict, client: Any) -> EpisodeResult:
        from verifiers import OpenAIChatCompletionsClient

        sampling = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        try:
            output = await self.vf_env.run_rollout(task, OpenAIChatCompletionsClient(client), self.options.model, sampling)
        except Exception as error:  # the environment's own code raised: its episode is marked, the run goes on
            return EpisodeResult(0.0, "env_crash", reason=f"verifiers rollout raised {type(error).__name__}: {error}")
        return _result(output)

    def _splits(self) -> tuple[Any, Any]:
        """(training rows, held-out rows): the environment's own eval_dataset, else a hash split of its dataset."""
        train = self.vf_env.get_dataset() if self.vf_env.dataset is not None else None
        if train is None or len(train) == 0:
            raise VerifiersError(f"verifiers environment {self.options.environment!r} has no training dataset")
        if self.vf_env.eval_dataset is not None:
            held_out = self.vf_env.get_eval_dataset()
            if len(held_out) == 0:
                raise VerifiersError(f"verifiers environment {self.options.environment!r}: its eval_dataset is empty")
            return train, held_out
        fraction = self.options.heldout_fraction
        is_eval = [_prompt_hash(row["prompt"]) < fraction for row in train]
        held_out = train.select([i for i, e in enumerate(is_eval) if e])
        train = train.select([i for i, e in enumerate(is_eval) if not e])
        if len(held_out) == 0 or len(train) == 0:
            empty = "held-out" if len(held_out) == 0 else "training"
            raise VerifiersError(
                f"verifiers environment {self.options.environment!r}: heldout_fraction={fraction} leaves the {empty} split "
                f"of its {len(is_eval)} rows empty; change heldout_fraction or give the environment an eval_dataset"
            )
        return train, held_out


def _load(options: VerifiersOptions) -> Any:
    try:
        import verifiers
    except ImportError as error:
        raise VerifiersError(f"env verifiers needs the verifiers package: pip install 'asyncrl[verifiers]' ({error})") from error
    if not hasattr(verifiers, "SingleTurnEnv"):
        raise VerifiersError(
            f"verifiers {verifiers.__version__} has no classic environment API (SingleTurnEnv, Rubric); "
            "this adapter needs verifiers>=0.3.1,<0.4 (pip install 'asyncrl[verifiers]')"
        )
    ref, args = options.environment, options.environment_args
    try:
        if ":" in ref:
            from asyncrl.plugins import import_target

            from .registry import EnvironmentNotFound

            try:
                env = import_target(ref, ref, "verifiers environment", EnvironmentNotFound)(**args)
            except EnvironmentNotFound as error:
                raise VerifiersError(str(error)) from None
        else:
            env = verifiers.load_environment(ref, **args)
    except VerifiersError:
        raise
    except Exception as error:  # the environment's own loader failed: say whose and why
        raise VerifiersError(f"verifiers environment {ref!r} could not be loaded with {sorted(args)}: {error}") from error
    if not isinstance(env, verifiers.Environment):
        raise VerifiersError(f"verifiers environment {ref!r} built a {type(env).__name__}, not a verifiers Environment")
    return env


def _not_an_empty_reply(record: logging.LogRecord) -> bool:
    return "EmptyModelResponseError" not in record.getMessage()


def _prompt_hash(prompt: Any) -> float:
    """A stable position in [0, 1) for a prompt (messages or text), the same in every process."""
    text = json.dumps(prompt, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64


def _result(output: Any) -> EpisodeResult:
    """The rollout's reward and rubric metrics; its error, timeout or stop as the episode's status."""
    from verifiers import EmptyModelResponseError, ModelError, OverlongPromptError

    metrics: dict[str, Any] = dict(output.get("metrics") or {})
    metrics["stop_condition"] = stop = output.get("stop_condition")
    metrics["truncated"] = bool(output.get("is_truncated"))
    reward = output.get("reward")
    error = _error_class(output.get("error"))
    if error is not None and issubclass(error, EmptyModelResponseError):
        # The policy ended its reply at once: verifiers calls that an error, but it is a sample like any
        # other (recorded by the gateway), worth nothing, and training must see it to unlearn it.
        return EpisodeResult(0.0, "ok", {**metrics, "empty_reply": True})
    if error is not None:
        # A policy call that failed (the gateway refused it) is the policy's, not the environment's.
        status: EpisodeStatus = "error" if issubclass(error, ModelError | OverlongPromptError) else "env_crash"
        return EpisodeResult(0.0, status, metrics, reason=f"verifiers rollout error: {output['error'].get('error_chain_str')}")
    if stop == "prompt_too_long" and not metrics.get("num_turns"):
        return EpisodeResult(0.0, "error", metrics, reason="the first prompt is longer than the policy's context")
    if stop == "timeout_reached":
        return EpisodeResult(0.0, "timeout", metrics, reason="the environment's timeout_seconds ran out")
    if reward is None or not math.isfinite(float(reward)):
        return EpisodeResult(0.0, "env_crash", metrics, reason=f"the rubric gave no finite reward ({reward!r})")
    return EpisodeResult(float(reward), "ok", metrics)


def _error_class(error: Any) -> type[BaseException] | None:
    """The exception class a rollout's serialized error names (verifiers keeps `{"error": class name, ...}`);
    an unknown name is an exception of the environment's own."""
    if error is None:
        return None
    import verifiers

    found = getattr(verifiers, str(error.get("error", "")), None) if isinstance(error, dict) else None
    return found if isinstance(found, type) and issubclass(found, BaseException) else Exception
