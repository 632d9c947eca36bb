"""Environments, a floor-1 component: the contract (`base`: episodes, and demonstrations for SFT), the
built-in tasks (arithmetic reasoning, the python-tool task, general instructions), the loader by
name or import path (`registry`), the episode runner that plays an episode through any rollout
lifecycle (`runner`), held-out evaluation through evaluation rollouts (`evaluation`), rewards
(`rewards`) and the sandboxes tool code runs in (`sandbox`). envs imports no other component: the
gateway is reached through `asyncrl.lifecycle.RolloutLifecycle` and the OpenAI client. How to
write one: docs/ENVIRONMENTS.md; its contract test is `asyncrl.jobs.contract.check_environment`."""
