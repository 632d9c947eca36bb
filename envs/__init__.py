"""Environments: the built-in tasks (arithmetic reasoning, tool-call demonstrations) and, later, agentic plug-ins."""
