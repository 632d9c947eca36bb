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
    parts.py       what the loop drives, typed: the learner client, the worker group and its supervision, `Parts`
    learners.py    the learner client over a Ray actor, or in this process
    workers.py     the worker group (the engines, and the push to all of them) over Ray actors, or in this process
    supervision.py engines that die, replaced while the run goes on
    weight_push.py the driver's side of pushes the learner sends to the engines itself (broadcast, CUDA IPC)
    ray_calls.py   Ray actor calls as asyncio futures, and telling an actor's death from other failures
    tasks.py       the task mix (ratios, rate limits) and the distillation prompt mix
    rundir.py      the run directory: config, checkpoints, metrics, plots, summary
    display.py     the live display (or plain lines)

Nothing below imports this package: the components expose verbs (an engine's generate, the gateway's
chat completions and rollout lifecycle, an environment's run_episode, the learner's train_step) and
these modules own the order they are called in. The weights take one
verb per layer: the worker group pushes (`WorkerGroup.push`), a rollout worker loads
(`RolloutWorker.load_weights`), an engine updates between two steps (`EngineFront.update_weights`), and
its core loads them (`load_weights`).
"""
