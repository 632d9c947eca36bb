"""Floor 2, the entry points: each job builds the components a command needs, drives them, and
reports (docs/ARCHITECTURE.md, "Three floors"). The loop they drive is `asyncrl.sched`, which imports
none of them.

    run.py       `asyncrl run`: start-up (SFT warm start, Ray actors, store, gateways), the loop, shutdown, summary
    sft.py       `asyncrl sft`: the SFT warm start
    distill.py   `asyncrl distill`: a run with teachers, and its refusals
    pipeline.py  `asyncrl pipeline`: the stages in order; matrix.py its evaluation matrix
    serve.py     `asyncrl serve`: engines and the TITO gateway, by hand; `asyncrl token`'s credentials
    cluster.py   the Ray a job's actors live in, local or a cluster, and the checks that refuse a cluster it cannot use
    usage.py     where a run's time went: each process's CPU and each engine's busy time
    contract.py  `check_environment`, the contract test for environment authors (a gateway and an engine, no Ray)
"""
