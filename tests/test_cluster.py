"""The cluster section and the checks that refuse a cluster a run cannot work on, before any actor starts:
bad addresses, an SQLite store on a cluster, resources the cluster lacks, a run directory the learner's
node does not share. The run on a real multi-node cluster is tests/test_cluster_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.configs import ConfigError, load_config
from asyncrl.jobs.cluster import check_shared_run_dir, resources_needed, shortfalls, start_ray, write_shared_check

CLUSTER = ["cluster.address=auto", "store.type=redis"]


@pytest.mark.parametrize("address", ["local", "auto", "10.0.0.1:6379", "head.example:6379", "ray://head:10001"])
def test_addresses_ray_accepts_are_accepted(address):
    store = [] if address == "local" else ["store.type=redis"]
    assert load_config("quickstart", [f"cluster.address={address}", *store]).cluster.address == address


def test_bad_cluster_keys_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"cluster.address: 'head' is not local, auto, host:port or ray://host:port"):
        load_config("quickstart", ["cluster.address=head", "store.type=redis"])
    with pytest.raises(ConfigError, match=r"cluster.engine_resources: CPU, GPU are set by rollout.cpus_per_worker"):
        load_config("quickstart", [*CLUSTER, "cluster.engine_resources.CPU=1", "cluster.engine_resources.GPU=1"])
    with pytest.raises(ConfigError, match=r"cluster.learner_resources: amounts must be positive \(trainer\)"):
        load_config("quickstart", [*CLUSTER, "cluster.learner_resources.trainer=0"])


def test_a_cluster_run_with_the_sqlite_store_is_refused():
    with pytest.raises(ConfigError, match=r"cluster.address 'auto' needs store.type redis: an SQLite store is a file on one machine"):
        load_config("quickstart", ["cluster.address=auto"])


def test_what_the_actors_ask_for_is_summed_and_each_shortfall_named():
    config = load_config(
        "quickstart",
        [*CLUSTER, "rollout.num_workers=3", "rollout.cpus_per_worker=2", "learner.num_ranks=2", "learner.num_cpus=4",
         "learner.device=cuda", "cluster.engine_resources.rollout=1", "cluster.learner_resources.trainer=0.5"],
    )  # fmt: skip
    needed = resources_needed(config)
    assert needed == {"CPU": 14.0, "GPU": 2.0, "rollout": 3.0, "trainer": 1.0}
    assert resources_needed(config, learner=False) == {"CPU": 6.0, "GPU": 0.0, "rollout": 3.0}  # what `asyncrl serve` starts
    problems = shortfalls(needed, {"CPU": 16.0, "GPU": 1.0, "rollout": 3.0})
    assert problems == [
        "the run's actors need 2 GPUs (rollout.num_workers x rollout.gpus_per_worker + learner.num_ranks x learner.gpus_per_rank, "
        "a whole GPU each where a device is cuda (+ teachers)), the Ray cluster has 1",
        "the run's actors need 1 of custom resource 'trainer' (cluster.engine_resources / learner_resources / teacher_resources), "
        "the Ray cluster has 0",
    ]


def test_an_address_nothing_listens_on_is_refused_at_once():
    with pytest.raises(ConfigError, match=r"cluster.address '127.0.0.1:1': nothing answers there"):
        start_ray(load_config("quickstart", ["cluster.address=127.0.0.1:1", "store.type=redis"]))


def test_a_run_directory_the_learner_does_not_see_is_refused(tmp_path):
    path, token = write_shared_check(tmp_path)
    assert Path(path).read_text() == token
    check_shared_run_dir(tmp_path, [])  # every rank read it back
    with pytest.raises(ConfigError, match=r"runs_dir: the run directory .* is not the same directory on learner rank 1 \(node n2\)"):
        check_shared_run_dir(tmp_path, ["learner rank 1 (node n2)"])


def test_the_run_command_takes_the_cluster_address_as_a_flag(capsys):
    from asyncrl.cli import EXIT_CONFIG_ERROR, main

    assert main(["run", "quickstart", "store.type=redis", "--address", "ray://head:10001", "--dry-run"]) == 0
    assert "address: ray://head:10001" in capsys.readouterr().out
    assert main(["run", "quickstart", "--address", "auto", "--dry-run"]) == EXIT_CONFIG_ERROR  # the SQLite store
    assert "needs store.type redis" in capsys.readouterr().err


def test_label_selectors_no_node_matches_are_named():
    from asyncrl.jobs.cluster import unlabelled

    config = load_config("quickstart", [*CLUSTER, "cluster.engine_labels.role=rollout", "cluster.learner_labels.role=trainer",
                                        "cluster.teacher_labels.role=judge"])  # fmt: skip
    nodes = [{"role": "rollout", "zone": "a"}, {"zone": "b"}]
    assert unlabelled(config, nodes) == ["cluster.learner_labels: no node of the Ray cluster has the labels {'role': 'trainer'}"]
    assert unlabelled(config, nodes, learner=False) == []  # the engines' alone
    operators = load_config("quickstart", [*CLUSTER, "cluster.learner_labels.role='!rollout'"])  # quoted: YAML reads ! as a tag
    assert unlabelled(operators, nodes) == []  # left to Ray


def test_serve_takes_the_cluster_address_as_a_flag_and_puts_its_engines_there(capsys):
    from asyncrl.cli import EXIT_CONFIG_ERROR, main
    from asyncrl.jobs.serve import build_service

    assert main(["serve", "quickstart", "store.type=redis", "--address", "ray://head:10001", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "address: ray://head:10001" in out and "engines: ray" in out
    assert main(["serve", "quickstart", "store.type=redis", "--address", "127.0.0.1:1"]) == EXIT_CONFIG_ERROR
    assert "cluster.address '127.0.0.1:1': nothing answers there" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"the engines run on the cluster only with gateway.engines=ray"):
        build_service(load_config("quickstart", [*CLUSTER, "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1"]))
