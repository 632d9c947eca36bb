"""The TITO (token-in, token-out) gateway: an OpenAI-compatible HTTP API in front of the engines.

Built so far: the records of what every call sampled (`records`), the trajectory store with its
exactly-once hand-off to the learner (`store`), the assembly of learner samples from trajectories
(`samples`) and the export of a run's trajectories (`export`). The HTTP gateway itself is not built
yet: see the gateway/store issue.
"""
