"""Reward plug-ins: how an answer is scored, separate from the environment that asks the question.

One small interface (`Reward.score`, base.py) and these implementations: rule functions (rules.py),
a reward-model service over HTTP (http.py), an LLM judge with a rubric behind any OpenAI-compatible
endpoint (judge.py), answer checks (answers.py: math-verify, exact, regex) and unit tests run in the
sandbox (code_tests.py). `load_reward` (registry.py) builds one from a config
reference, by name or import path, as environments are loaded.
"""

from .base import Reward, RewardError, RewardResult
from .registry import RewardNotFound, load_reward
from .rules import rule

__all__ = ["Reward", "RewardError", "RewardNotFound", "RewardResult", "load_reward", "rule"]
