"""asyncrl: asynchronous agentic RL post-training of language models.

The component packages (`asyncrl.rollout`, `asyncrl.learner`, `asyncrl.gateway`, `asyncrl.envs`,
`asyncrl.distill`, `asyncrl.sched`, `asyncrl.configs`) live in the folders of the same names at the
repository root; this package holds what they share: the CLI, the policy (tiny model, tokenizer,
MTP module, checkpoints) and the benchmarks.
"""

__version__ = "0.1.0"
