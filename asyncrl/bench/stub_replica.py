"""A gateway replica over stub engines, in a process of its own: the second gateway of `asyncrl bench
scale`'s sessions through several replicas. It serves as `asyncrl run`'s replica actors do (uvicorn on its
own event loop, the same store, the run's secret, announced in the store), over `ToolUsingEngine`s of its
own (stubs hold no state an engine shares between gateways), until it is terminated."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection

from asyncrl.configs.schema import RunConfig

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def stub_replica(config: RunConfig, store_path: str, secret: bytes, replica_id: str, engine_latency_s: float) -> Iterator[StubReplica]:
    """A running replica process; stopped (SIGTERM, then its clean shutdown) on the way out."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no event loop or threads of this one
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve, args=(config, store_path, secret, replica_id, engine_latency_s, theirs), daemon=True)
    process.start()
    if not ours.poll(START_TIMEOUT_S):
        process.kill()
        raise RuntimeError(f"the stub gateway replica {replica_id} did not start within {START_TIMEOUT_S:g} s")
    replica = StubReplica(replica_id, ours.recv(), process)
    try:
        yield replica
    finally:
        process.terminate()
        process.join(30)
        if process.is_alive():
            process.kill()


class StubReplica:
    def __init__(self, replica_id: str, url: str, process) -> None:
        self.id, self.url, self.process = replica_id, url, process

    def cpu_s(self) -> float:
        """CPU seconds the replica's process has used so far."""
        import psutil

        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system


def _serve(config: RunConfig, store_path: str, secret: bytes, replica_id: str, engine_latency_s: float, ready: Connection) -> None:
    from asyncrl.gateway.app import run_loop

    run_loop(_serving(config, store_path, secret, replica_id, engine_latency_s, ready))


async def _serving(config: RunConfig, store_path: str, secret: bytes, replica_id: str, engine_latency_s: float, ready: Connection) -> None:
    from asyncrl.gateway.app import settle_heap
    from asyncrl.gateway.serving import InProcessGateway
    from asyncrl.gateway.store import open_store
    from asyncrl.policy.tokenizer import build_tokenizer

    from .agentic import ENGINES, STORE_NAMESPACE, ToolUsingEngine

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    store = open_store(store_path, namespace=STORE_NAMESPACE)
    tokenizer = build_tokenizer()
    engines = [ToolUsingEngine(f"{replica_id}-stub-{i}", tokenizer, engine_latency_s) for i in range(ENGINES)]
    served = InProcessGateway(config, store, engines, tokenizer, model_name="bench-agentic", replica_id=replica_id, secret=secret)
    try:
        async with served as lifecycle:
            settle_heap()
            ready.send(lifecycle.url)
            await stop.wait()
    finally:
        store.close()
