"""`asyncrl run` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, as Ray's own
tests do): a head that only hosts the driver, two engine nodes and a learner node, each its own raylet with
its own resources; the Redis store. The engines go to different nodes and the learner to its own, and a
run whose engine node is killed (every process of it, kill -9) goes on: the dead engine's placement bundle
moves to the node with room, its replacement serves at the current version, and the books balance."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import pytest
from loop_helpers import CoinEnv, run_config

from asyncrl.gateway.store import open_store

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # four raylets, then a run across them

WAIT_S = 120.0
"""Longest wait for the run to replace the dead engine (a safety valve: the wait ends on the record)."""
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_timeout_ms": 500}
"""The head's failure detection (a node is dead after ~2 s of missed health checks, not Ray's default ~30 s)."""


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    from asyncrl.rollout.worker import RAY_SYSTEM_CONFIG

    assert not ray.is_initialized(), "a test before this one left its Ray connected"
    head = dict(num_cpus=0, include_dashboard=False, _system_config={**RAY_SYSTEM_CONFIG, **FAST_NODE_DEATH})
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = {
        "a": cluster.add_node(num_cpus=1, resources={"rollout": 1}, labels={"role": "rollout"}),
        "b": cluster.add_node(num_cpus=1, resources={"rollout": 2}, labels={"role": "rollout"}),  # room for a replacement
        "c": cluster.add_node(num_cpus=1, resources={"trainer": 1}, labels={"role": "trainer"}),
    }
    cluster.wait_for_nodes()
    yield cluster, nodes
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def cluster_config(tmp_path, cluster, name: str, *overrides: str, learner: str = "cluster.learner_resources.trainer=1"):
    """Two engines that need a `rollout` resource; the learner placed by `learner` (a resource, or a label)."""
    return run_config(
        tmp_path, f"name={name}", f"cluster.address={cluster.address}", "store.type=redis", f"store.namespace=cluster-{uuid.uuid4().hex}",
        "rollout.num_workers=2", "cluster.engine_resources.rollout=1", learner, *overrides,
    )  # fmt: skip


def check_books(summary: dict, config) -> None:
    """Every rollout the store started is in exactly one account, read from the store, not the logs."""
    ledger = dict(summary["ledger"])
    started = ledger.pop("started")
    assert summary["balanced"] and sum(ledger.values()) == started > 0, summary
    store = open_store(config.store.url, namespace=config.store.namespace)
    try:
        trajectories = store.list()
        assert len(trajectories) == len({t.rollout_id for t in trajectories}) == started
        assert store.counts()["acked"] == started  # each acknowledged once: trained, dropped and aborted alike
    finally:
        store.close()


def test_a_run_spreads_its_engines_over_nodes_and_puts_the_learner_on_its_own(tmp_path, cluster):
    """The learner goes by its node label: an engine node has half a CPU to spare, which it would fit."""
    from asyncrl.configs import ConfigError
    from asyncrl.jobs.run import run

    ray_cluster, nodes = cluster
    with pytest.raises(ConfigError, match=r"cluster.learner_labels: no node of the Ray cluster has the labels \{'role': 'judge'\}"):
        run(cluster_config(tmp_path, ray_cluster, "unlabelled", learner="cluster.learner_labels.role=judge"), env=CoinEnv())
    assert not ray.is_initialized()  # refused before any actor started, and let go of the cluster
    config = cluster_config(tmp_path, ray_cluster, "spread", "loop.steps=2", learner="cluster.learner_labels.role=trainer")
    summary = run(config, env=CoinEnv())
    check_books(summary, config)
    assert summary["version"] == 2 and summary["engine_versions"] == [2, 2]
    placed = summary["usage"]["nodes"]
    engine_nodes = {placed["engine:spread-rollout-0"], placed["engine:spread-rollout-1"]}
    assert engine_nodes == {nodes["a"].node_id, nodes["b"].node_id}  # one engine on each engine node
    assert placed["learner"] == [nodes["c"].node_id]
    assert (tmp_path / "spread" / "checkpoints" / "step-000002").is_dir()  # written on node c, read here


def test_a_run_across_nodes_broadcasts_its_pushes_from_the_learners_node(tmp_path, cluster):
    """rollout.weight_transport=broadcast: the learner on node c serves the group's rendezvous at its node's
    address and the engines on nodes a and b join it; every push reaches both."""
    from asyncrl.jobs.run import run

    ray_cluster, nodes = cluster
    config = cluster_config(tmp_path, ray_cluster, "broadcast", "loop.steps=2", "rollout.weight_transport=broadcast")
    summary = run(config, env=CoinEnv())
    check_books(summary, config)
    assert summary["version"] == 2 and summary["engine_versions"] == [2, 2] and summary["weight_transport"] == "broadcast"
    placed = summary["usage"]["nodes"]
    assert {placed["engine:broadcast-rollout-0"], placed["engine:broadcast-rollout-1"]} == {nodes["a"].node_id, nodes["b"].node_id}
    assert placed["learner"] == [nodes["c"].node_id]


class NodeLossEnv(CoinEnv):
    """CoinEnv that calls `lose()` (which kills a node) in the first episode after `when()` holds, on the
    driver's main thread as Ray's node start-up needs (the event loop waits the few seconds it takes);
    with `until`, episodes after that wait until `until(gateway)` holds (WAIT_S: a safety valve)."""

    def __init__(self, when, lose, until=None) -> None:
        super().__init__()
        self.when, self.lose, self.until = when, lose, until
        self.lost_at_episode: int | None = None

    async def run_episode(self, task, client):
        if self.lost_at_episode is None and self.when():
            self.lost_at_episode = self.episodes
            self.lose()
        if self.lost_at_episode is not None and self.until is not None:
            gateway = client.with_options(base_url=str(client.base_url).removesuffix("v1/"))
            deadline = time.monotonic() + WAIT_S
            while not await self.until(gateway) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        return await super().run_episode(task, client)


async def replacement_serves(gateway) -> bool:
    """Whether the gateway routes to a replacement engine (`<engine id>-r<n>`; a first one placed in the bundle
    before Ray moved it off the dead node dies starting, and the next one is r2)."""
    health = await gateway.get("health", cast_to=object)
    return any(re.search(r"-r\d+$", engine["engine_id"]) for engine in health["engines"])


@pytest.mark.chaos
def test_a_run_whose_engine_node_dies_replaces_the_engine_elsewhere_and_finishes(tmp_path, cluster):
    """Two gateway replicas (the driver's, and an actor on the learner's node), each serving the rollouts it
    opened. The episodes after the kill wait until the replacement serves at their rollout's replica, so
    the steps after it are sampled by it as well, however long Ray takes to notice the death and start it."""
    from asyncrl.gateway.replicas import home_of
    from asyncrl.jobs.run import run

    ray_cluster, nodes = cluster
    config = cluster_config(
        tmp_path, ray_cluster, "lost", "loop.steps=6", "learner.checkpoint_every=2", f"loop.episode_timeout_s={2 * WAIT_S}",
        "gateway.replicas=2", "cluster.gateway_labels.role=trainer",
    )  # fmt: skip
    checkpointed = lambda: (tmp_path / "lost" / "checkpoints" / "step-000002").is_dir()  # noqa: E731
    env = NodeLossEnv(checkpointed, lambda: ray_cluster.remove_node(nodes["a"], allow_graceful=False), until=replacement_serves)
    summary = run(config, env=env)
    assert env.lost_at_episode is not None
    check_books(summary, config)
    assert summary["version"] == 6 and summary["engine_versions"] == [6, 6]
    (replaced,) = [r for r in summary["recoveries"] if r["event"] == "worker_replaced"]
    assert replaced["version"] >= 2  # it joined at the weights of its time, not the start's
    placed = summary["usage"]["nodes"]
    assert placed[f"engine:{replaced['replacement']}"] == nodes["b"].node_id  # the only node with room
    assert f"engine:{replaced['engine_id']}" not in placed
    assert all(summary["gateway_replicas"]["opened"][replica] > 0 for replica in ("g0", "g1"))
    assert placed["gateway:g1"] == nodes["c"].node_id  # cluster.gateway_labels: the learner's node, which lives
    store = open_store(config.store.url, namespace=config.store.namespace)
    try:  # both replicas routed turns to the replacement once it joined
        replacement = replaced["replacement"]
        served_by_replacement = {home_of(t.rollout_id) for t in store.list() for turn in t.turns if turn.engine_id == replacement}
    finally:
        store.close()
    assert served_by_replacement == {"g0", "g1"}


@pytest.mark.chaos
def test_a_run_whose_learner_node_dies_restarts_the_learner_on_another_node(tmp_path, cluster):
    """A node with room for a learner joins, then the learner's node is killed: the learner restarts there
    from the last checkpoint, which it reads from the shared run directory, and the run finishes."""
    from asyncrl.jobs.run import run

    ray_cluster, nodes = cluster
    config = cluster_config(tmp_path, ray_cluster, "trainer-lost", "loop.steps=6", "learner.checkpoint_every=2")
    joined = {}

    def lose_the_learner_node() -> None:
        joined["node"] = ray_cluster.add_node(num_cpus=1, resources={"trainer": 1})
        ray_cluster.remove_node(nodes["c"], allow_graceful=False)

    checkpointed = lambda: (tmp_path / "trainer-lost" / "checkpoints" / "step-000002").is_dir()  # noqa: E731
    env = NodeLossEnv(checkpointed, lose_the_learner_node)
    summary = run(config, env=env)
    assert env.lost_at_episode is not None
    check_books(summary, config)
    assert summary["version"] == 6 and summary["engine_versions"] == [6, 6]
    (restarted,) = [r for r in summary["recoveries"] if r["event"] == "learner_restarted"]
    assert restarted["checkpoint"].endswith(("step-000002", "step-000004"))
    assert summary["usage"]["nodes"]["learner"] == [joined["node"].node_id]


def test_a_local_run_beside_a_running_cluster_starts_a_ray_of_its_own(cluster):
    """A cluster on this machine (which a bare `ray.init()` would join, then refuse num_cpus) is left alone."""
    from asyncrl.configs import load_config
    from asyncrl.jobs.cluster import start_ray

    ray_cluster, _ = cluster
    assert start_ray(load_config("quickstart", ["learner.num_cpus=0.5", "rollout.cpus_per_worker=0.5"])) is True
    try:
        assert ray.get_runtime_context().gcs_address != ray_cluster.address
        assert not any(node.get("Labels", {}).get("role") for node in ray.nodes())  # none of the cluster's nodes
    finally:
        ray.shutdown()


def test_serve_with_an_address_starts_its_engines_on_the_cluster(tmp_path, cluster):
    """`asyncrl serve --address` as a user runs it (a subprocess): its engines on the two engine nodes, an
    agent's call answered through them."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    import openai
    from gateway_helpers import serve_banner

    ray_cluster, nodes = cluster
    command = [
        sys.executable, "-m", "asyncrl", "serve", "quickstart", f"runs_dir={tmp_path}", "name=served",
        "store.type=redis", f"store.namespace=serve-{uuid.uuid4().hex}", "gateway.auth=false", "rollout.num_workers=2",
        "cluster.engine_resources.rollout=1", "rollout.cpus_per_worker=0.5", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1",
        "policy.tiny.num_heads=2", "policy.tiny.intermediate_size=32", "rollout.sampling.max_tokens=4", "--address", ray_cluster.address,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url, _ = serve_banner(process)
        opened = httpx.post(url + "/rollouts", json={"task": "demo"}).json()
        agent = openai.OpenAI(base_url=url + "/v1", api_key=opened["api_key"], max_retries=0)
        reply = agent.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        deadline = time.monotonic() + WAIT_S  # a safety valve: the loop ends once both heartbeats named their node
        while time.monotonic() < deadline:
            engines = httpx.get(url + "/health").json()["engines"]
            placed = {engine["health"].get("node_id") for engine in engines}
            if len(engines) == 2 and None not in placed:
                break
            time.sleep(0.2)
        assert placed == {nodes["a"].node_id, nodes["b"].node_id}  # spread: one engine on each engine node
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(60)
