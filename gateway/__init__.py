"""The TITO (token-in, token-out) gateway, a floor-1 component: an OpenAI-compatible HTTP API in front
of the engines.

`app` (HTTP routes; the two OpenAI routes as `lean_route`s) over `service` (rollouts by key; render
with `template`, generate, parse, record) over `pool` (engines: registry, routing, heartbeats,
retries) and `engines` (in-process, Ray and HTTP handles over any rollout engine, an `asyncrl.rollout.EngineFront`).
What every call sampled is recorded (floor 0's `Turn`) in the trajectory store (`store`, its own
sub-package, with its contract split by caller), and exported (`export`). `client` (HTTP) and
`lifecycle` (in-process) are the rollout lifecycle; `serving` serves the gateway on the caller's
event loop; `inspect` is `asyncrl trajectories`.
"""
