"""The learner, a floor-1 component: the RL objectives (`objectives`, the distillation advantage among
them), sample selection and the ledger's accounts (`selection`), micro-batches (`batch`), the RL
learner (`rl`) and its Ray actor (`actor`, whose weights the loop pushes), and the SFT training step and
data (`sft`, `sft_data`). It trains on floor 0's `Batch`es of `Sample`s, reports a `StepResult`, and
imports no other component."""
