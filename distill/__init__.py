"""On-policy cross-stage distillation: teachers score the student's own samples (docs/DISTILLATION.md).

A leaf component: `teachers.py` routes every finished sample to the teacher of its stage through the
`TeacherScorer` protocol (a checkpoint's `ScoringWorker` actor, or a gateway's scoring endpoint over
HTTP), attaches the teacher's log-probs and measures the reverse KL. The per-token advantage is
beside the other objectives (`learner/objectives/advantages.py`); the prompt mix (`sched/tasks.py`) and
`asyncrl distill` (`asyncrl/jobs/distill.py`) are wiring.
"""
