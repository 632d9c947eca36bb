"""The learner: SFT warm start, held-out evaluation and the RL objectives."""
