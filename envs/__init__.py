"""Environments: the contract (`base`), the built-in tasks (arithmetic reasoning, tool-call
demonstrations), the reasoning and agentic environments, the loader by name or import path
(`registry`), the episode runner that records an episode through the gateway (`runner`), held-out
evaluation (`evaluation`), the contract test for environment authors (`contract`) and the sandboxes
tool code runs in (`sandbox`). How to write one: docs/ENVIRONMENTS.md."""
