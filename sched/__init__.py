"""Floor 2, the loop: what `asyncrl run` repeats until the learner has taken its steps, and the parts it
drives (docs/ARCHITECTURE.md, "Three floors"). The entry points that build those parts and start the
loop are `asyncrl.jobs`; nothing here imports them.

    loop.py        the loop's verbs: admit -> collect -> train -> evaluate -> report; close
    admission.py   how many GRPO groups may start now (a pure function of the loop's numbers)
    episodes.py    the episodes in flight (asyncio tasks, one rollout each)
    groups.py      GRPO groups from admission until the learner takes them
    steps.py       one learner step: taking it, and its metrics record, batch record and warnings
    evaluation.py  the loop's evaluate verb (held-out success through evaluation rollouts)
    resume.py      the books: ledger, acknowledgement at checkpoints (the commit point), recovery
    recovery.py    parts that die mid-run: worker replacements recorded, the learner restarted
    shutdown.py    `close`: the end of a run, every rollout in exactly one account
    parts.py       what the loop drives, typed: the learner and worker-group clients, the store's loop side, `Parts`
    clients.py     those clients over Ray actors, or over objects in this process
    weight_push.py the driver's side of pushes the learner sends to the engines itself (broadcast, CUDA IPC)
    tasks.py       the task mix (ratios, rate limits) and the distillation prompt mix
    rundir.py      the run directory: config, checkpoints, metrics, plots, summary
    display.py     the live display (or plain lines)

Nothing below imports this package: the components expose verbs (generate, record, run_episode,
train_step, update_weights) and these modules own the order they are called in.
"""
