"""Floor 2, the wiring: `asyncrl run`, `pipeline`, `sft`, `serve` and `distill`, which build the
components and drive them (docs/ARCHITECTURE.md, "Three floors").

    run.py        start-up and shutdown (SFT warm start, Ray actors, store, in-process gateway), summary
    loop.py       the loop's verbs: admit -> collect -> train -> evaluate -> report; close
    admission.py  how many GRPO groups may start now (a pure function of the loop's numbers)
    episodes.py   the episodes in flight (asyncio tasks, one rollout each)
    evaluation.py the loop's evaluate verb (held-out success through evaluation rollouts)
    steps.py      one learner step: taking it, and its metrics record, batch record and warnings
    resume.py     the books: ledger, acknowledgement at checkpoints (the commit point), recovery
    recovery.py   parts that die mid-run: worker replacements recorded, the learner restarted
    shutdown.py   `close`: the end of a run, every rollout in exactly one account
    parts.py      what the loop drives, typed: the learner and worker-group clients, the store's loop side, `Parts`
    clients.py    those clients over Ray actors, or over objects in this process
    groups.py     GRPO groups from admission until the learner takes them; trajectories -> samples
    tasks.py      the task mix (ratios, rate limits) and the distillation prompt mix
    rundir.py     the run directory: config, checkpoints, metrics, plots, summary
    display.py    the live display (or plain lines)
    sft.py        the SFT warm start (`asyncrl sft`)
    pipeline.py   the staged pipeline (`asyncrl pipeline`); matrix.py its evaluation matrix
    distill.py    `asyncrl distill`: a run with teachers, and its refusals
    serve.py      `asyncrl serve`: engines and the TITO gateway
    contract.py   `check_environment`, the contract test for environment authors

Nothing below imports this package: the components expose verbs (generate, record, run_episode,
train_step, update_weights) and these modules own the order they are called in.
"""
