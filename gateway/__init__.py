"""The TITO (token-in, token-out) gateway: an OpenAI-compatible HTTP API in front of the engines.

Not built yet: see the gateway/store issue.
"""
