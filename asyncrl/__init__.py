"""asyncrl: asynchronous agentic RL post-training of language models.

The component packages (`asyncrl.rollout`, `asyncrl.learner`, `asyncrl.gateway`, `asyncrl.envs`,
`asyncrl.distill`), the wiring (`asyncrl.sched`) and the configs (`asyncrl.configs`) live in the
folders of the same names at the repository root. This package holds floor 0's shared records
(`records`, `samples`, `lifecycle`), the policy (tiny model, tokenizer, MTP module, checkpoints) and
the metrics log (`runlog`), and floor 2's CLI (`cli`) and benchmarks (`bench`).
"""

__version__ = "0.1.0"
