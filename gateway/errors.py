"""The gateway's refusals: an HTTP status and an OpenAI-style error code, raised anywhere below the
routes and mapped to a response by `app.py` (nothing that raises them knows HTTP)."""

from __future__ import annotations


class GatewayError(Exception):
    """A refusal with an HTTP status and an OpenAI-style error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def bad_request(message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message)
