"""Benchmark: a long run of the gateway, to show that nothing it holds grows without bound.

The gateway runs in a child process as `asyncrl serve` runs it (uvicorn, the start-up heap frozen out
of the collector), over two `StubEngine`s (asyncrl/bench/gateway.py: asyncio.sleep, no CPU) and a real
trajectory store (SQLite by default, `bench.store=redis` for Redis). Here, `bench.sessions` clients
play episodes back to back for `bench.minutes`: open a rollout, one or two chat turns, finish it; a
consumer claims and acks finished trajectories as the learner would, so the hand-off is exercised too.

Every `bench.sample_s` (a minute by default) one sample: the gateway process's RSS and open file
descriptors (/proc), the store's size (rollouts, turns, bytes), the chat calls' latency p50/p99 in
that interval, and episodes done. At the end, a least-squares slope over the second half of the
samples: a quantity "grows" when its fitted change over that half exceeds both a relative and an
absolute tolerance (GROWTH_TOLERANCE). The store grows with the episodes it records by design, so
its verdict is on bytes per episode.

The gateway remembers the ids of ended rollouts up to a cap (`gateway.max_ended_rollouts`,
100,000, ~20 MiB when full): a soak shorter than ~100,000 episodes would see that memory still
filling and could only call it bounded with a tolerance as big as the cap. So the soak's gateway
runs with `bench.ended_cap` (2,000 by default, ~0.4 MiB): its plateau comes within the first
minutes, the RSS tolerance is tight (2 MiB over the second half), and a run whose episodes had not
filled the cap before the second half began is "inconclusive", never "bounded".

Output: the JSON (with the RSS slope over the second half, MiB/min), and a PNG of every series next
to it; while it runs, PATH.partial.json holds the samples so far.

    asyncrl bench soak --minutes 30 --json runs/soak/soak30.json
    asyncrl bench soak --minutes 10 bench.store=redis --json runs/soak/redis.json
    asyncrl bench soak --minutes 120 bench.ended_cap=100000 --json runs/soak/served-cap.json
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import platform
import random
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configs.schema import RedisStoreConfig, RunConfig, Section

from .gateway import TOOLS, StubEngine, _completion_ids

ENGINES = 2

GROWTH_TOLERANCE: dict[str, tuple[float, float]] = {
    "rss_mib": (0.0, 2.0),
    "open_fds": (0.10, 4.0),
    "store_bytes_per_episode": (0.10, 512.0),
    "latency_p50_ms": (0.50, 10.0),
    "latency_p99_ms": (0.50, 50.0),
}
"""Quantity -> (relative to its mean, absolute): the fitted change over the second half must exceed both
to count as growth. RSS: 2 MiB whatever the gateway's size (0.13 MiB/min over a 30-minute soak's second
half): above the ~1.2 MiB of pydantic-core's JSON string cache (16,384 short strings, filling over the
first ~20,000 requests), a tenth of the served cap of ended rollouts (~19 MiB). Latency is loose: the machine is shared, and a
neighbour's load is not a leak."""


class SoakBenchOptions(Section):
    """Settings of `asyncrl bench soak` itself (`bench.KEY=VALUE` on the command line)."""

    minutes: float = Field(30.0, gt=0.0, le=7 * 24 * 60)
    """How long the episodes run."""
    sample_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Seconds between samples."""
    store: Literal["sqlite", "redis"] = "sqlite"
    """The trajectory store: a SQLite file in a scratch directory, or the config's Redis server (store.url)."""
    sessions: int = Field(8, ge=1, le=10_000)
    """Clients playing episodes back to back."""
    engine_latency_s: float = Field(0.05, ge=0.0, le=60.0)
    """Time each model call takes at the stub engines."""
    think_s: float = Field(0.4, ge=0.0, le=60.0)
    """Most time a client waits between its calls (uniform), so calls do not arrive in lockstep."""
    ended_cap: int = Field(2_000, ge=1, le=10_000_000)
    """Ended rollouts the soak's gateway remembers (its gateway.max_ended_rollouts, 100,000 as served): low, so that this
    capped memory is full within the first minutes and growth after that is a leak; 100000 soaks the served cap."""


def _serve(store: str, namespace: str, latency_s: float, ended_cap: int, ready) -> None:
    """Child process: the gateway over stub engines; sends (port, run token or None)."""
    from asyncrl.configs.schema import GatewayConfig, SamplingConfig
    from asyncrl.gateway.app import create_app, gateway_server, run_loop, settle_heap
    from asyncrl.gateway.pool import EnginePool
    from asyncrl.gateway.service import GatewayService
    from asyncrl.gateway.store import open_store
    from asyncrl.policy.tokenizer import build_tokenizer

    config = GatewayConfig(max_ended_rollouts=ended_cap)
    pool = EnginePool(config)
    for i in range(ENGINES):
        pool.add_local(StubEngine(f"stub-{i}", _completion_ids(), latency_s))
    service = GatewayService(open_store(store, namespace=namespace), build_tokenizer(), pool, config, SamplingConfig(max_tokens=64))
    credentials = getattr(service, "credentials", None)  # a gateway with authentication: lifecycle calls need the run token
    server = gateway_server(create_app(service), config, host="127.0.0.1", port=0, backlog=4096, log_level="error")

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        ready.put((server.servers[0].sockets[0].getsockname()[1], getattr(credentials, "run_token", None)))
        await task

    parent = os.getppid()

    def exit_with_parent() -> None:  # a soak killed by a signal must not leave its gateway running
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    settle_heap()
    run_loop(main())


class _GatewayProcess:
    def __init__(self, store: str, namespace: str, latency_s: float, ended_cap: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready = context.Queue()
        self.process = context.Process(target=_serve, args=(store, namespace, latency_s, ended_cap, self.ready), daemon=True)

    def __enter__(self) -> tuple[str, dict, int]:
        self.process.start()
        port, run_token = self.ready.get(timeout=180)
        headers = {"Authorization": f"Bearer {run_token}"} if run_token else {}
        assert self.process.pid is not None
        return f"http://127.0.0.1:{port}", headers, self.process.pid

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


class _Tally:
    """What the clients saw since the last sample (latencies) and in all (episodes, errors)."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.episodes = self.requests = self.errors = 0
        self.first_errors: list[str] = []

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(what)

    def take_latencies(self) -> list[float]:
        taken, self.latencies = self.latencies, []
        return taken


async def _episodes(http, url: str, run_headers: dict, tally: _Tally, stop: asyncio.Event, index: int, think_s: float) -> None:
    rng = random.Random(index)
    messages = [{"role": "system", "content": "You run python."}, {"role": "user", "content": "What is 2+2? Check with python."}]
    while not stop.is_set():
        try:
            async with http.post(url + "/rollouts", json={"task": "soak", "group_id": f"g{index}"}, headers=run_headers) as response:
                if response.status != 200:
                    tally.error(f"open {response.status}: {(await response.read())[:200]!r}")
                    continue
                opened = await response.json()
            key = {"Authorization": f"Bearer {opened['api_key']}"}
            conversation = list(messages)
            for _ in range(rng.choice((1, 2))):
                await asyncio.sleep(rng.uniform(0, think_s))
                start = time.perf_counter()
                chat = {"messages": conversation, "tools": TOOLS}
                async with http.post(url + "/v1/chat/completions", json=chat, headers=key) as response:
                    body = await response.read()
                tally.latencies.append(time.perf_counter() - start)
                tally.requests += 1
                if response.status != 200:
                    tally.error(f"chat {response.status}: {body[:200]!r}")
                    break
                reply = json.loads(body)["choices"][0]["message"]
                conversation += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "4"}]
            finish = {"reward": rng.choice((0.0, 1.0))}
            async with http.post(f"{url}/rollouts/{opened['rollout_id']}/finish", json=finish, headers=run_headers) as response:
                if response.status != 200:
                    tally.error(f"finish {response.status}: {(await response.read())[:200]!r}")
                    continue
            tally.episodes += 1
        except Exception as error:  # a refused connection or a reset: counted, and the soak goes on
            tally.error(f"{type(error).__name__}: {error}")
            await asyncio.sleep(0.1)


class _Consumer(threading.Thread):
    """Claims finished trajectories and acks them, as the learner does, until stopped."""

    def __init__(self, store: str, namespace: str) -> None:
        super().__init__(daemon=True, name="soak-consumer")
        self.store_address, self.namespace = store, namespace
        self.stopping = threading.Event()
        self.acked = 0

    def run(self) -> None:
        from asyncrl.gateway.store import open_store

        store = open_store(self.store_address, namespace=self.namespace)
        try:
            while not self.stopping.is_set():
                claimed = store.claim("soak", 256, block_s=0.5)
                if claimed:
                    self.acked += store.ack("soak", [t.rollout_id for t in claimed])
                else:
                    self.stopping.wait(0.5)
        finally:
            store.close()


def _process_memory(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of `pid`."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _sqlite_size(path: Path) -> tuple[int, int, int]:
    """(rollouts, turns, bytes on disk with the WAL) of the SQLite store at `path`."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rollouts = db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
        turns = db.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
    finally:
        db.close()
    size = sum(p.stat().st_size for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists())
    return rollouts, turns, size


def _redis_size(url: str, namespace: str) -> tuple[int, int, int]:
    """(rollouts, turns, bytes) of the run's keys on the Redis server at `url` (bytes: MEMORY USAGE summed)."""
    import redis

    from asyncrl.records import FINISH_STATUSES

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        prefix = f"asyncrl:{namespace}:"
        statuses = {"running", "aborted", *FINISH_STATUSES}
        counts: dict[str, str] = client.hgetall(prefix + "counts")  # type: ignore[assignment]
        rollouts = sum(int(value) for status, value in counts.items() if status in statuses)
        keys = [str(key) for key in client.scan_iter(prefix + "*", count=1000)]
        turn_lists = [key for key in keys if key.startswith(prefix + "turns:")]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key)
        for key in turn_lists:
            pipe.llen(key)
        replies = pipe.execute()
        size = sum(n or 0 for n in replies[: len(keys)])
        return rollouts, sum(replies[len(keys) :]), size
    finally:
        client.close()


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def _soak(url: str, run_headers: dict, pid: int, options: SoakBenchOptions, store_size, progress) -> dict:
    import aiohttp

    tally, stop = _Tally(), asyncio.Event()
    samples: list[dict] = []
    connector = aiohttp.TCPConnector(limit=options.sessions)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        clients = [asyncio.create_task(_episodes(http, url, run_headers, tally, stop, i, options.think_s)) for i in range(options.sessions)]
        start = time.monotonic()
        end = start + 60 * options.minutes
        next_sample = start
        while True:
            now = time.monotonic()
            if now >= next_sample or now >= end:
                samples.append(await _sample(now - start, pid, tally, store_size))
                progress(samples)
                next_sample += options.sample_s
            if now >= end:
                break
            await asyncio.sleep(max(0.0, min(next_sample, end) - time.monotonic()))
        stop.set()
        await asyncio.gather(*clients)
    return {"samples": samples, "episodes": tally.episodes, "chat_requests": tally.requests, "errors": tally.errors,
            "first_errors": tally.first_errors}  # fmt: skip


async def _sample(elapsed_s: float, pid: int, tally: _Tally, store_size) -> dict:
    rss_mib, fds = _process_memory(pid)
    rollouts, turns, size = await asyncio.to_thread(store_size)
    latencies = tally.take_latencies()
    p50, p99 = _percentile(latencies, 50), _percentile(latencies, 99)
    return {
        "t_min": round(elapsed_s / 60, 3), "rss_mib": round(rss_mib, 2), "open_fds": fds,
        "store_rollouts": rollouts, "store_turns": turns, "store_bytes": size,
        "store_bytes_per_episode": round(size / rollouts, 1) if rollouts else None,
        "latency_p50_ms": None if p50 is None else round(1000 * p50, 2),
        "latency_p99_ms": None if p99 is None else round(1000 * p99, 2),
        "chat_requests": len(latencies), "episodes_done": tally.episodes, "errors": tally.errors,
    }  # fmt: skip


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def verdict(samples: list[dict], ended_cap: int | None = None) -> dict:
    """Per quantity of GROWTH_TOLERANCE: its fitted slope per minute over the second half of the run, the
    change that implies across that half, and whether that is growth; plus the overall answer, which is
    "inconclusive" when the gateway's capped memory of `ended_cap` ended rollouts was still filling as
    the second half began (its filling would read as growth, or hide a leak behind a loose tolerance)."""
    end = samples[-1]["t_min"] if samples else 0.0
    second_half = [s for s in samples if s["t_min"] >= end / 2]
    fits: dict[str, dict] = {}
    growing = []
    for name, (relative, absolute) in GROWTH_TOLERANCE.items():
        points = [(s["t_min"], float(s[name])) for s in second_half if s.get(name) is not None]
        if len(points) < 2:
            fits[name] = {"samples": len(points), "verdict": "too few samples"}
            continue
        slope = _slope(points)
        span = points[-1][0] - points[0][0]
        mean = statistics.fmean(y for _, y in points)
        change = slope * span
        grows = change > max(relative * abs(mean), absolute)
        fits[name] = {
            "slope_per_min": round(slope, 4), "change_over_second_half": round(change, 3), "mean": round(mean, 3),
            "first": points[0][1], "last": points[-1][1], "tolerance": max(relative * abs(mean), absolute),
            "verdict": "grows" if grows else "bounded",
        }  # fmt: skip
        if grows:
            growing.append(f"{name} grows {slope:+.3g}/min over the second half ({points[0][1]} -> {points[-1][1]})")
    fitted = [f for f in fits.values() if f["verdict"] != "too few samples"]
    overall = "; ".join(growing) if growing else ("bounded" if fitted else "too few samples")
    filled = next((s["t_min"] for s in samples if ended_cap is not None and s.get("episodes_done", 0) >= ended_cap), None)
    if ended_cap is not None and fitted and (filled is None or filled > end / 2):
        when = "not by the end" if filled is None else f"only at minute {filled}"
        overall = (f"inconclusive: the {ended_cap} ended rollouts the gateway remembers (bench.ended_cap) filled {when}, "
                   f"after the second half began at minute {end / 2:g}; lower bench.ended_cap or raise bench.minutes")  # fmt: skip
    rss = fits.get("rss_mib", {})
    return {"result": overall, "rss_mib_per_min": rss.get("slope_per_min"), "ended_cap_filled_at_min": filled, "fits": fits}


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("rss_mib", "gateway RSS (MiB)"), ("open_fds", "open file descriptors"), ("store_bytes", "store bytes"),
        ("store_bytes_per_episode", "store bytes per episode"), ("latency_p50_ms", "chat p50 (ms)"),
        ("latency_p99_ms", "chat p99 (ms)"), ("episodes_done", "episodes done"),
    ]  # fmt: skip
    figure, axes = plt.subplots(len(series), 1, figsize=(7, 2.0 * len(series)), sharex=True)
    for axis, (name, label) in zip(axes, series, strict=True):
        points = [(s["t_min"], s[name]) for s in samples if s.get(name) is not None]
        axis.plot([x for x, _ in points], [y for _, y in points], marker=".")
        axis.set_ylabel(label, fontsize=8)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    figure.suptitle("asyncrl bench soak")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def run(config: RunConfig, json_path: str | None = None, options: SoakBenchOptions | None = None) -> dict:
    options = options or SoakBenchOptions()
    namespace = f"bench-soak-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="asyncrl-soak-") as scratch:
        if options.store == "redis":
            address = config.store.url if isinstance(config.store, RedisStoreConfig) else RedisStoreConfig().url
            store_size = lambda: _redis_size(address, namespace)  # noqa: E731
        else:
            address = str(Path(scratch) / "trajectories.db")
            store_size = lambda: _sqlite_size(Path(address))  # noqa: E731
        consumer = _Consumer(address, namespace)
        started = time.time()
        progress = functools.partial(_write_progress, Path(json_path) if json_path else None, options)
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the `with` below stops the gateway
        try:
            with _GatewayProcess(address, namespace, options.engine_latency_s, options.ended_cap) as (url, run_headers, pid):
                consumer.start()
                results = asyncio.run(_soak(url, run_headers, pid, options, store_size, progress))
        finally:
            signal.signal(signal.SIGTERM, previous)
            consumer.stopping.set()
            if consumer.is_alive():
                consumer.join(30)
            if options.store == "redis":
                _drop_namespace(address, namespace)
    results = {
        **verdict(results["samples"], options.ended_cap), **results, "acked": consumer.acked,
        "setup": {
            **options.model_dump(), "engines": f"{ENGINES} StubEngine (asyncio.sleep)", "started_at": started,
            "ended_cap_as_served": _served_ended_cap(),
            "tolerances": {k: {"relative": r, "absolute": a} for k, (r, a) in GROWTH_TOLERANCE.items()},
            "machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count(),
        },
    }  # fmt: skip
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        path.with_suffix(".partial.json").unlink(missing_ok=True)
        if results["samples"]:
            plot(results["samples"], path.with_suffix(".png"))
            results["plot"] = str(path.with_suffix(".png"))
    return results


def _write_progress(path: Path | None, options: SoakBenchOptions, samples: list[dict]) -> None:
    """The samples so far, beside the final JSON (PATH.partial.json), so a long soak can be watched."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.json")
    partial.write_text(
        json.dumps({**verdict(samples, options.ended_cap), "samples": samples, "setup": options.model_dump()}, indent=2) + "\n"
    )


def _served_ended_cap() -> int:
    from asyncrl.configs.schema import GatewayConfig

    return GatewayConfig().max_ended_rollouts


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _drop_namespace(url: str, namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(f"asyncrl:{namespace}:*", count=1000))
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i : i + 1000])
    client.close()
