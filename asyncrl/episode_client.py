"""The OpenAI client an episode gets: the official `openai.AsyncOpenAI`, whose plain JSON posts skip the
SDK's request building when the gateway's app runs in this process.

`client.post(path, cast_to=object, body=...)` is how an environment sends a request and takes the JSON
reply as it is (envs/reasoning.py). Through the SDK, that post builds its request (options, URL,
headers, retries) and sends it through the HTTP client's stack: ~0.3 ms of the driver's CPU per
episode, a quarter of it (docs/BENCHMARKS.md, "learn"). Where the HTTP client hands requests to the
gateway's app in this process (its `direct` transport, `gateway/inprocess_transport.py`), the same
request goes straight to that transport: the same route, validation, key check and recording as
any call, and the same reply. A refusal raises the exception the SDK raises for it (made by the
SDK's own `_make_status_error_from_response` from the same response).

Everything else (typed calls such as `chat.completions.create`, streams, options, files, a client
that retries or has default headers or query parameters of its own) goes through the SDK unchanged.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx2
import openai


class EpisodeClient(openai.AsyncOpenAI):
    """`openai.AsyncOpenAI`; its `http_client` may carry a `direct` transport (an `httpx2.AsyncBaseTransport`)
    for the plain JSON posts above."""

    def __init__(self, **kwargs: Any) -> None:
        if isinstance(kwargs.get("base_url"), str):
            kwargs["base_url"] = _parsed_base_url(kwargs["base_url"])
        super().__init__(**kwargs)
        direct = getattr(kwargs.get("http_client"), "direct", None)
        self._direct: httpx2.AsyncBaseTransport | None = direct if isinstance(direct, httpx2.AsyncBaseTransport) else None

    async def post(self, path: str, *, cast_to: Any, body: Any = None, options: Any = None, **rest: Any) -> Any:
        # A client that retries, or sends headers or query parameters of its own, takes the SDK's path:
        # those are its business, not this one's.
        plain = cast_to is object and isinstance(body, dict) and not options and not any(rest.values()) and not self.max_retries
        customized = getattr(self, "_custom_headers", None) or getattr(self, "_custom_query", None)
        if self._direct is None or not plain or customized:
            sdk_options: Any = options or {}
            return await super().post(path, cast_to=cast_to, body=body, options=sdk_options, **rest)
        url = str(self.base_url).rstrip("/") + "/" + path.lstrip("/")
        headers = {"authorization": f"Bearer {self.api_key}", "content-type": "application/json", "accept": "application/json"}
        request = httpx2.Request("POST", url, headers=headers, content=json.dumps(body).encode())
        response = await self._direct.handle_async_request(request)
        response.request = request  # as the HTTP client sets it; the SDK's error reads it
        await response.aread()
        if response.status_code >= 400:
            raise self._make_status_error_from_response(response)
        return response.json()


@functools.lru_cache(maxsize=256)
def _parsed_base_url(base_url: str) -> httpx2.URL:
    """`base_url` parsed once, with the trailing slash the SDK gives it: parsing it was half of building a
    client, and an episode builds one per rollout (every rollout of a gateway has the same base URL)."""
    return httpx2.URL(base_url if base_url.endswith("/") else base_url + "/")
