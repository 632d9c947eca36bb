"""Environments: the contract (`base`), the built-in tasks (arithmetic reasoning, tool-call
demonstrations), the reasoning environment and the episode runner that records an episode through
the gateway. Sandboxed agentic environments and plug-in loading come with the agentic issue."""
