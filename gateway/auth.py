"""Who may call what on a gateway: two tokens derived from the gateway's secret, least privilege each.

- The run token (`rt-…`): the rollout lifecycle (open, finish, abort, describe) and scoring. Held by
  whoever runs episodes: the scheduler, an env runner, a distillation student, a person at a shell.
- The engine token (`et-…`): engine registration, heartbeats and deregistration. Held by engines.
- Rollout keys (`rk-…`, `rollouts.RolloutTable.key`): the calls of one rollout, nothing else.

Each token is an HMAC of a fixed label under the secret, so every gateway of a run (and `asyncrl token`,
which reads the run's secret file) derives the same tokens without storing them anywhere. The labels
start with a NUL byte, which no rollout id contains, so no rollout key's MAC is ever a token.
Tokens are secrets: nothing here logs or prints them, and `repr` hides them.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

RUN_TOKEN_PREFIX = "rt-"
ENGINE_TOKEN_PREFIX = "et-"
ROLLOUT_KEY_PREFIX = "rk-"


def _derive(secret: bytes, label: str) -> str:
    return hmac.new(secret, b"\x00asyncrl/" + label.encode(), hashlib.sha256).hexdigest()[:48]


@dataclass(frozen=True)
class Credentials:
    run_token: str = field(repr=False)
    engine_token: str = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> Credentials:
        if len(secret) < 16:
            raise ValueError(f"a gateway secret needs at least 16 bytes, got {len(secret)}")
        return cls(RUN_TOKEN_PREFIX + _derive(secret, "run-token"), ENGINE_TOKEN_PREFIX + _derive(secret, "engine-token"))

    def is_run_token(self, presented: str | None) -> bool:
        return _same(presented, self.run_token)

    def is_engine_token(self, presented: str | None) -> bool:
        return _same(presented, self.engine_token)


def _same(presented: str | None, expected: str) -> bool:
    # compare_digest takes str only when both are ASCII; a header may carry anything latin-1.
    return presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode())


def refusal(needed: str, presented: str | None) -> str:
    """Why a call with `presented` (a bearer token or None) was refused, for a route that needs `needed`
    ("run" or "engine"); it says what was sent wrong without echoing it."""
    how = {
        "run": "the run token (`asyncrl token CONFIG` prints an `asyncrl serve` run's; in code: GatewayService.credentials.run_token)",
        "engine": "the engine token (`asyncrl token CONFIG --engine`; in code, GatewayService.credentials.engine_token)",
    }[needed]
    if not presented:
        return f"this route needs {how}: send it as `Authorization: Bearer <token>`"
    sent = (
        "a rollout key, which only opens that rollout's own calls (chat, completions, tokens/generate)"
        if presented.startswith(ROLLOUT_KEY_PREFIX)
        else "the engine token"
        if presented.startswith(ENGINE_TOKEN_PREFIX) and needed == "run"
        else "the run token"
        if presented.startswith(RUN_TOKEN_PREFIX) and needed == "engine"
        else "a token this gateway did not issue"
    )
    return f"the bearer token is {sent}; this route needs {how}"
