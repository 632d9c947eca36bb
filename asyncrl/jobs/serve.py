"""`asyncrl serve CONFIG`: the engines, the store and the gateway, for use by hand.

An agent developer points an unmodified agent at the printed base URL with a rollout key from
`POST /rollouts`, then reads what was recorded with `asyncrl trajectories show`. Runs until Ctrl-C.

The lifecycle calls take the run token and engines on other machines the engine token; both derive
from the secret kept in the run directory (mode 0600), and `asyncrl token RUN_DIR [--engine]` prints
them. Neither is ever printed or logged by the gateway.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import signal
import sys
import threading
from pathlib import Path

from asyncrl.configs import ConfigError
from asyncrl.configs.schema import RunConfig

SECRET_FILE = "gateway.secret"


def run_directory(config: RunConfig) -> Path:
    return Path(config.runs_dir) / config.name


def _secret(run_dir: Path) -> bytes:
    """Kept in the run directory, so rollout keys stay valid across a restart of the gateway, and shared by
    gateway replicas started with the same config (several may start at once: the file appears whole, once)."""
    path = run_dir / SECRET_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        draft = run_dir / f".{SECRET_FILE}.{os.getpid()}"
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32))
        try:
            os.link(draft, path)  # atomic, and refused where another process got there first
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return bytes.fromhex(path.read_text().strip())


def run_credentials(run_dir: Path):
    """The tokens of the gateway `asyncrl serve` runs for `run_dir`, from its secret file."""
    from asyncrl.gateway.auth import Credentials

    path = Path(run_dir) / SECRET_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no gateway secret at {path}: `asyncrl serve` with this config creates it when it starts")
    return Credentials.from_secret(bytes.fromhex(path.read_text().strip()))


def _engines(config: RunConfig, model, mtp=None) -> list:
    from asyncrl.gateway.engines import LocalEngine, RayEngine

    rollout = config.rollout
    if config.gateway.engines == "ray":
        import ray

        from asyncrl.rollout.worker import WorkerLauncher

        from .cluster import start_ray

        start_ray(config, learner=False)  # a Ray of its own, or cluster.address's
        launcher = WorkerLauncher(model, rollout, mtp, placement=config.cluster)
        names = [f"{config.name}-rollout-{i}" for i in range(rollout.num_workers)]
        workers = [launcher.start(name, slot) for slot, name in enumerate(names)]
        ray.get([worker.version.remote() for worker in workers])  # built, before the gateway's heartbeats watch them
        return [RayEngine(worker, name) for worker, name in zip(workers, names, strict=True)]
    if not config.cluster.is_local:
        raise ConfigError(
            f"cluster.address {config.cluster.address!r}: the engines run on the cluster only with gateway.engines=ray "
            "(asyncrl serve --address sets it)"
        )
    from asyncrl.rollout import EmbeddedEngine

    return [LocalEngine(EmbeddedEngine(model, rollout.embedded(), engine_id=f"engine-{i}", mtp=mtp)) for i in range(rollout.num_workers)]


def _policy(config: RunConfig):
    """(model, tokenizer, MTP layer or None): the layer only when the engines draft with it."""
    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.policy.validate import check_policy_directory

    check_policy_directory(config.policy)
    drafting = config.rollout.mtp_drafting
    policy = config.policy.model_copy(update={"mtp": config.policy.mtp.model_copy(update={"enabled": drafting})})
    if drafting and config.policy.path is not None:
        from asyncrl.policy.checkpoint import load_policy

        # build_policy would give a checkpoint without one a fresh, untrained layer: refuse instead.
        model, tokenizer, mtp = load_policy(config.policy.path, config.policy.dtype, config.policy.chat_template)
        if mtp is None:
            raise ValueError(
                f"rollout.mtp_drafting: the checkpoint {config.policy.path} has no MTP layer to draft with "
                "(train one with policy.mtp.enabled, or set rollout.mtp_drafting=false)"
            )
        return model, tokenizer, mtp
    # The tiny policy starts with a fresh MTP layer, as it does in a run with policy.mtp.enabled.
    return build_policy(policy, config.seed)


def build_service(config: RunConfig):
    """(service, engine handles) for `config`; the policy is policy.path or the tiny policy."""
    from asyncrl.gateway.pool import EnginePool
    from asyncrl.gateway.replicas import ReplicaSet
    from asyncrl.gateway.service import GatewayService
    from asyncrl.sched.rundir import RunDir

    model, tokenizer, mtp = _policy(config)
    handles = _engines(config, model, mtp)
    gateway = config.gateway
    if "sampling_overrides" not in gateway.model_fields_set:
        # Served by hand (agent development, a judge): sample as each request asks unless the config says otherwise.
        gateway = gateway.model_copy(update={"sampling_overrides": "allow"})
    pool = EnginePool(gateway)
    for handle in handles:
        pool.add_local(handle)
    name = Path(config.policy.path).name if config.policy.path else f"asyncrl-tiny-{config.policy.tiny.arch}"
    store = RunDir.for_config(config).open_store(config)
    replicas = ReplicaSet(store, gateway.replica_id, gateway.replica_ttl_s) if gateway.replica_id else None
    service = GatewayService(
        store, tokenizer, pool, gateway, config.rollout.sampling,
        secret=_secret(run_directory(config)), model_name=name, replicas=replicas,
    )  # fmt: skip
    return service, handles


def serve(config: RunConfig) -> int:
    from asyncrl.gateway.app import create_app, gateway_server, run_loop, settle_heap
    from asyncrl.gateway.replicas import advertised_url, announced

    service, handles = build_service(config)
    server = gateway_server(create_app(service), config.gateway)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if not server.started:
            return await task
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        url = advertised_url(config.gateway.advertise_url, host, port)
        try:
            async with announced(service.replicas, url, service.io):
                print(_banner(config, url, len(handles), service), flush=True)
                await task
        except ValueError as error:  # a replica id another live gateway announced
            server.should_exit = True
            await task
            raise ConfigError(str(error)) from None

    settle_heap()
    # uvicorn stops on SIGTERM, then raises the signal again under the handler found at start: this one
    # turns it into an exit that runs the clean-up below (the store's last writes, the engines).
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    stopped: SystemExit | None = None
    try:
        run_loop(main())
    except SystemExit as stop:  # SIGTERM (`_terminated`)
        stopped = stop
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        service.close()
        service.store.close()
        for handle in handles:
            getattr(getattr(handle, "engine", None), "shutdown", lambda: None)()
    if stopped is not None:
        _exit_now(stopped)
    return 0


def _exit_now(stopped: SystemExit) -> None:
    """End the process once everything is closed. The interpreter's own teardown of a ~1 GB heap, beside
    threads still tokenizing a big prompt, took 5-6 s more on a loaded machine; SIGTERM must be quick."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # its atexit hook would not run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stopped.code if isinstance(stopped.code, int) else 1)


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _banner(config: RunConfig, url: str, engines: int, service) -> str:
    where = "in-process" if config.gateway.engines == "in_process" else "Ray"
    replicas = service.replicas
    peers = f"replica {replicas.id} of {', '.join(sorted(replicas.peers))}; " if replicas else ""
    token = f"asyncrl token {shlex.quote(str(run_directory(config)))}"
    if config.gateway.auth:
        how = [f"lifecycle calls take the run token, which `{token}` prints (engines elsewhere: `{token} --engine`)."]
        auth = f' -H "authorization: Bearer $({token})"'
    else:
        how, auth = ["gateway.auth is false: lifecycle calls need no token (loopback only)."], ""
    return "\n".join([
        f"asyncrl gateway listening on {url}  ({peers}{engines} {where} engine(s), store {service.store!r})",
        "",
        *how,
        "open a rollout:",
        f"  curl -s -X POST {url}/rollouts{auth} -H 'content-type: application/json' -d '{{\"task\": \"demo\"}}'",
        "point an unmodified agent at it:",
        f"  openai.OpenAI(base_url=\"{url}/v1\", api_key=\"<api_key from the answer above>\")",
        "finish it:",
        f"  curl -s -X POST {url}/rollouts/<rollout_id>/finish{auth} -H 'content-type: application/json' -d '{{\"reward\": 1.0}}'",
        "see what was recorded:",
        f"  asyncrl trajectories list {_store_argument(config)}",
        "",
        "Ctrl-C stops the gateway.",
    ])  # fmt: skip


def _store_argument(config: RunConfig) -> str:
    """What to hand `asyncrl trajectories` to read this run's store."""
    if config.store.type == "redis":
        return f"{config.store.url} --namespace {config.store.namespace or config.name}"
    return str(config.store.path or run_directory(config))
