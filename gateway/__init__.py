"""The TITO (token-in, token-out) gateway: an OpenAI-compatible HTTP API in front of the engines.

`app` (HTTP routes; the two OpenAI routes as `lean_route`s) over `service` (rollouts by key; render
with `template`, generate, parse, record) over `pool` (engines: registry, routing, heartbeats,
retries) and `engines` (in-process, Ray and HTTP handles).
What every call sampled is recorded (`records`) in the trajectory store with its exactly-once
hand-off to the learner (`store`), assembled into learner samples (`samples`) and exported
(`export`). `serve` is `asyncrl serve`; `inspect` is `asyncrl trajectories`.
"""
