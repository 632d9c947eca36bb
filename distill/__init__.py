"""On-policy cross-stage distillation: teachers score the student's own samples (docs/DISTILLATION.md).

- `advantage.py`: the per-token advantage and the reverse-KL metric (the math);
- `teachers.py`: teacher scoring engines (Ray actors) and the routing of samples to them;
- `mix.py`: the student's prompt mix over the stages' tasks;
- `run.py`: `asyncrl distill`, the scheduler's loop with teachers attached.
"""
