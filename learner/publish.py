"""Weight publishing: one versioned state dict to every rollout worker.

On CPU the weights travel through the Ray object store: one `ray.put` (or the ObjectRef a
`LearnerActor.state` call already returned), then every worker reads that one copy. Workers keep
serving while they load; the call returns once every engine has switched, so the next token any of
them samples carries `version`. (`rollout.weight_transport=broadcast` sends them from the learner's
device instead: `asyncrl/weight_transfer.py`, `sched/weight_push.py`.)
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch


def push_weights(
    workers: Sequence, state_dict: dict[str, torch.Tensor] | ray.ObjectRef, version: int, timeout_s: float | None = None
) -> list[int]:
    """Load `state_dict` as `version` into every `RolloutWorker`; returns the version each reports.

    Raises if any worker failed to load the weights (its engine keeps the previous ones), or if the
    workers did not all finish within `timeout_s` seconds.
    """
    ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(state_dict)
    versions = ray.get([worker.update_weights.remote(ref, version) for worker in workers], timeout=timeout_s)
    if any(v != version for v in versions):
        raise RuntimeError(f"pushed version {version} but workers report {versions}")
    return versions
