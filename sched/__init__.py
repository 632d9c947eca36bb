"""The scheduler: `asyncrl run` wires engines, gateway, episodes and learner into one loop.

    run.py      start-up and shutdown (SFT warm start, Ray actors, store, in-process gateway), summary
    loop.py     the loop's verbs: admit -> collect -> train -> evaluate -> report; recover and close
    groups.py   GRPO groups from admission until the learner takes them; trajectories -> samples
    rundir.py   the run directory: config, checkpoints (the commit point), metrics, plot, summary
    display.py  the live display (or plain lines)

Components never call back up into this package: the engines, gateway, environments and learner
expose verbs (generate, record, run_episode, train_step, update_weights) and `sched/` owns the loop.
A run is one stage: RL over a task mix, or cross-stage distillation when the config lists
`distill.teachers` (distill/). A pipeline of stages is not scheduled yet.
"""
