"""Recorded samples re-scored under checkpoints: per-token log-probs, ratios, objective decisions, drift.

A *series* is one column of the report: a fixed checkpoint (`v12`, `start`, `final`, a directory), or
`nearest`, which scores each token under the run's kept checkpoint closest to the version that sampled
it (so its ratios show what the engine/learner mismatch alone does, without staleness). Every
checkpoint any series needs is loaded once and scores every sample that needs it, one scoring call per
temperature: each token is taken at `Sample.scoring_temperatures(run temperature)`, as the learner
takes it, so a ratio compares like with like.

Decisions come from the learner's own objective functions on the same float32 tensors the learner
would build (`double_sided_is_loss`, `icepop_grpo_loss` at the run's `learner.eps_low/eps_high/
icepop_beta`); a token they do not keep is `below` or `above` by the side of 1 its ratio lies on.

KL between two series a, b is estimated on the sampled tokens as mean(log p_a - log p_b): the k1
estimator, unbiased for KL(a || b) when the tokens are drawn from a. They are drawn from the rollout
policy, so it is exact for `rollout||X` and, for two checkpoints, as good as the nearer one is to
the rollout policy; it can come out negative on few tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from asyncrl.configs.learner import LearnerConfig
from asyncrl.configs.objectives import DoubleSidedISObjective, IcepopGRPOObjective
from asyncrl.learner.objectives import double_sided_is_loss, icepop_grpo_loss
from asyncrl.learner.selection import select
from asyncrl.learner.shaping import step_rows
from asyncrl.policy.tokenizer import TOOL_CALL_OPEN
from asyncrl.records import RequestError, Sample, Trajectory
from asyncrl.rollout.scoring import NativeScorer
from asyncrl.samples import batch_of, trajectory_to_samples

from .records import RolloutScore, TokenScore, TurnSummary
from .run import CheckpointRef, ReplayError, RunView

OBJECTIVES = ("double_sided_is", "icepop_grpo")
ROLLOUT = "rollout"
CHUNK = 64
"""Sequences per scoring call (one progress tick)."""

Progress = Callable[[int, int], None]
"""(done, total) in sequences scored."""


@dataclass(frozen=True)
class Series:
    """One column of the report: `ref` scores every token, or, with `ref` None (`nearest`), each token is
    scored under the kept checkpoint nearest the version that sampled it."""

    label: str
    ref: CheckpointRef | None

    def describe(self) -> dict:
        if self.ref is None:
            return {"label": self.label, "version": None, "path": None}
        return {"label": self.label, "version": self.ref.version, "path": str(self.ref.path) if self.ref.path else None}


@dataclass
class _Item:
    """One sample being re-scored, with what the report needs about its rollout."""

    sample: Sample
    temperatures: list[float]
    trained_version: int
    advantage: float | None
    account: str | None
    logprobs: dict[str, list[float]]
    nearest: list[int | None]

    @cached_property
    def sampled(self) -> list[int]:
        """Positions of the sampled tokens (loss mask 1)."""
        return [j for j, m in enumerate(self.sample.loss_mask) if m]


def rescore(
    view: RunView,
    trajectories: Sequence[Trajectory],
    series: Sequence[Series],
    scorers: Callable[[CheckpointRef], NativeScorer],
    tokenizer,
    *,
    objectives: Sequence[str] = OBJECTIVES,
    progress: Progress | None = None,
) -> list[RolloutScore]:
    """One `RolloutScore` per sample of `trajectories` (aborted and unfinished ones have none), scored
    under every series. `scorers(ref)` is called once per checkpoint needed, oldest first (the caller
    has checked they fit the run); `tokenizer` decodes token texts."""
    items = _items(view, trajectories)
    plan = _plan(view, items, series)
    total = sum(len(calls) for calls in plan.values())
    done = 0
    for ref, calls in plan.items():
        scorer = scorers(ref)
        by_temperature: dict[float, list[int]] = defaultdict(list)
        for index, temperature in calls:
            by_temperature[temperature].append(index)
        scored: dict[tuple[int, float], list[float]] = {}
        for temperature, indices in by_temperature.items():
            indices.sort(key=lambda i: len(items[i].sample.token_ids))  # similar lengths pad least
            for start in range(0, len(indices), CHUNK):
                chunk = indices[start : start + CHUNK]
                try:
                    results = scorer.score([items[i].sample.token_ids for i in chunk], temperature)
                except RequestError as error:  # a sequence the checkpoint cannot take (longer than its context)
                    raise ReplayError(
                        f"checkpoint {ref.label} cannot score rollout {items[chunk[0]].sample.rollout_id}'s batch: {error}"
                    ) from None
                scored.update({(i, temperature): r for i, r in zip(chunk, results, strict=True)})
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        _assign(items, series, ref, scored)
    labels = [s.label for s in series]
    checkpoints = [s.describe() for s in series]
    texts = _Texts(tokenizer)
    return [_report(view, item, labels, objectives, texts, checkpoints) for item in items]


# -- what to score --------------------------------------------------------------------------------


def _items(view: RunView, trajectories: Sequence[Trajectory]) -> list[_Item]:
    trained = _trained_versions(view)
    final = view.final_checkpoint().version
    groups: dict[str, tuple[dict[tuple[str, int], float], dict[str, str]]] = {}
    items = []
    for trajectory in trajectories:
        if trajectory.status == "running":
            continue  # nothing to score yet
        for sample in trajectory_to_samples(trajectory):
            if sample.group_id not in groups:
                groups[sample.group_id] = _group_advantages(view, sample.group_id, trained)
            advantages, accounts = groups[sample.group_id]
            items.append(
                _Item(
                    sample=sample,
                    temperatures=sample.scoring_temperatures(view.config.rollout.sampling.temperature),
                    trained_version=trained.get(sample.rollout_id, final),
                    advantage=advantages.get((sample.rollout_id, sample.branch)),
                    account=accounts.get(sample.rollout_id),
                    logprobs={},
                    nearest=[None] * len(sample.token_ids),
                )
            )
    return items


def _trained_versions(view: RunView) -> dict[str, int]:
    """Rollout id -> the version the learner step that trained it started from (its batch records)."""
    found: dict[str, int] = {}
    for step in view.rundir.batch_steps():
        record = view.rundir.read_batch(step)
        if record is not None:
            for group in record.groups:
                found.update(dict.fromkeys(group, record.learner_version))
    return found


def _group_advantages(view: RunView, group_id: str, trained: dict[str, int]) -> tuple[dict[tuple[str, int], float], dict[str, str]]:
    """(rollout id, branch) -> GRPO advantage, and rollout id -> account, as the learner's selection
    decides them over the group as recorded; empty when the store does not hold the whole group.

    Staleness is measured against the version of the step that trained the group when a batch record
    says so, else against the group's newest sampled version (the earliest it could have trained)."""
    learner = view.config.learner
    members = view.store.list(group_id=group_id)
    if len(members) < learner.group_size or any(not t.terminal for t in members):
        return {}, {}
    batch = batch_of([members], learner.crash_statuses)
    versions = [v for s in batch.samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    current = next((trained[t.rollout_id] for t in members if t.rollout_id in trained), max(versions, default=0))
    selection = select(
        batch.groups, current_version=current, max_staleness=learner.max_staleness, staleness_by=learner.staleness_by,
        group_size=learner.group_size, crash_statuses=learner.crash_statuses,
    )  # fmt: skip
    advantages: dict[tuple[str, int], float] = {}
    for sample, row in zip(selection.batch, step_rows(selection, learner, 1.0)[0], strict=True):
        advantages.setdefault((sample.rollout_id, sample.branch), row.advantage)
    return advantages, {rollout_id: account.value for rollout_id, account in selection.accounts.items()}


def _plan(view: RunView, items: list[_Item], series: Sequence[Series]) -> dict[CheckpointRef, list[tuple[int, float]]]:
    """Checkpoint -> the (item, temperature) scoring calls it makes, oldest checkpoint first: each item
    once per temperature among the sampled tokens it scores."""
    plan: dict[CheckpointRef, set[tuple[int, float]]] = defaultdict(set)
    nearest: dict[int, CheckpointRef] = {}  # version -> its nearest kept checkpoint (each lookup lists the directory)
    for index, item in enumerate(items):
        for s in series:
            for j in item.sampled:
                ref = s.ref
                if ref is None:
                    version = item.sample.versions[j]
                    ref = nearest[version] if version in nearest else nearest.setdefault(version, view.nearest_checkpoint(version))
                    item.nearest[j] = ref.version
                plan[ref].add((index, item.temperatures[j]))
    return {ref: sorted(plan[ref]) for ref in sorted(plan, key=lambda r: (r.version, str(r.path)))}


def needed_checkpoints(view: RunView, trajectories: Sequence[Trajectory], series: Sequence[Series]) -> list[CheckpointRef]:
    """Every checkpoint scoring these trajectories will load (so all are checked before any is scored)."""
    needed = [s.ref for s in series if s.ref is not None]
    if any(s.ref is None for s in series):
        versions = {v for t in trajectories for turn in t.turns for v in turn.versions}
        needed += [view.nearest_checkpoint(v) for v in sorted(versions)]
    return list(dict.fromkeys(needed))


def _assign(items: list[_Item], series: Sequence[Series], ref: CheckpointRef, scored: dict[tuple[int, float], list[float]]) -> None:
    """Each sampled token's log-prob under `ref`, for every series that takes it from `ref`."""
    for index in sorted({i for i, _ in scored}):
        item = items[index]
        for s in series:
            values = item.logprobs.setdefault(s.label, [0.0] * len(item.sample.token_ids))
            for j in item.sampled:
                if s.ref == ref or (s.ref is None and item.nearest[j] == ref.version):
                    values[j] = scored[(index, item.temperatures[j])][j]


# -- the report -----------------------------------------------------------------------------------


def _report(view: RunView, item: _Item, labels: list[str], objectives, texts: _Texts, checkpoints: list[dict]) -> RolloutScore:
    sample, sampled = item.sample, item.sampled
    rollout = torch.tensor([[sample.logprobs[j] for j in sampled]], dtype=torch.float32)
    ratios: dict[str, list[float]] = {}
    decisions: dict[str, dict[str, list[str]]] = {}
    for label in labels:
        logp = torch.tensor([[item.logprobs[label][j] for j in sampled]], dtype=torch.float32)
        ratios[label], decisions[label] = decide(logp, rollout, view.config.learner, objectives)
    order = {j: k for k, j in enumerate(sampled)}
    tokens = []
    for j, token_id in enumerate(sample.token_ids):
        token = TokenScore(
            position=j, token_id=token_id, text=texts(token_id), sampled=bool(sample.loss_mask[j]),
            turn=sample.token_turns[j] if sample.token_turns is not None else -1,
        )  # fmt: skip
        if token.sampled:
            k = order[j]
            token.rollout_logprob, token.version, token.temperature = sample.logprobs[j], sample.versions[j], item.temperatures[j]
            token.staleness, token.nearest_version = item.trained_version - sample.versions[j], item.nearest[j]
            if sample.kv_versions is not None:
                token.kv_version = sample.kv_versions[j]
                token.kv_staleness = item.trained_version - token.kv_version
            token.logprobs = {label: item.logprobs[label][j] for label in labels}
            token.ratios = {label: ratios[label][k] for label in labels}
            token.decisions = {label: {o: decisions[label][o][k] for o in objectives} for label in labels}  # type: ignore[misc]
        tokens.append(token)
    turns = []
    for turn in sample.turn_indices:
        own = [t for t in tokens if t.turn == turn and t.sampled]
        summary = TurnSummary(index=turn, sampled_tokens=len(own), tool_calls=sum(t.text == TOOL_CALL_OPEN for t in own))
        summary.mean_abs_delta, summary.max_abs_delta, summary.masked_fraction = _drift(own, labels, objectives)
        turns.append(summary)
    mean_delta, max_delta, masked = _drift([t for t in tokens if t.sampled], labels, objectives)
    figures = {
        "sampled_tokens": len(sampled), "mean_abs_delta": mean_delta, "max_abs_delta": max_delta,
        "masked_fraction": masked, "kl": _kl(tokens, labels), "trained_version": item.trained_version,
    }  # fmt: skip
    return RolloutScore(
        rollout_id=sample.rollout_id, branch=sample.branch, task=sample.task, status=sample.status, reward=sample.reward,
        group_id=sample.group_id, advantage=item.advantage, checkpoints=checkpoints, tokens=tokens, turns=turns,
        summary=figures, account=item.account,
    )  # fmt: skip


def glm5_bounds(learner: LearnerConfig) -> tuple[float, float, float]:
    """(eps_low, eps_high, beta) at which the GLM-5 masks are shown: the run's where its objective is one of
    them (beta: icepop_grpo's), the schema's defaults otherwise."""
    objective = learner.objective
    if not isinstance(objective, (IcepopGRPOObjective, DoubleSidedISObjective)):
        objective = IcepopGRPOObjective()
    beta = objective.beta if isinstance(objective, IcepopGRPOObjective) else IcepopGRPOObjective().beta
    return objective.eps_low, objective.eps_high, beta


def decide(logp: torch.Tensor, rollout: torch.Tensor, learner, objectives: Sequence[str]) -> tuple[list[float], dict[str, list[str]]]:
    """Ratios and, per objective, each token's decision: [1, N] log-probs in, the learner's functions' verdict out."""
    mask, advantages = torch.ones_like(logp), torch.zeros(logp.shape[0])
    eps_low, eps_high, beta = glm5_bounds(learner)
    outputs = {
        "double_sided_is": lambda: double_sided_is_loss(logp, rollout, advantages, mask, eps_low=eps_low, eps_high=eps_high),
        "icepop_grpo": lambda: icepop_grpo_loss(logp, rollout, advantages, mask, eps_low=eps_low, eps_high=eps_high, beta=beta),
    }
    ratios: list[float] = []
    decisions: dict[str, list[str]] = {}
    for objective in objectives:
        out = outputs[objective]()
        ratios = out.ratio[0].tolist()
        kept = out.kept[0].tolist()
        decisions[objective] = ["kept" if k else ("below" if r < 1.0 else "above") for k, r in zip(kept, ratios, strict=True)]
    if not objectives:
        ratios = torch.exp(logp - rollout)[0].tolist()
    return ratios, decisions


def _drift(tokens: list[TokenScore], labels, objectives) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
    """Mean and max |re-scored - rollout log-prob| and the masked fraction per objective, per label."""
    mean, largest, masked = {}, {}, {}
    for label in labels:
        deltas = [abs(t.logprobs[label] - t.rollout_logprob) for t in tokens if t.rollout_logprob is not None]
        if deltas:
            mean[label], largest[label] = sum(deltas) / len(deltas), max(deltas)
            masked[label] = {o: sum(t.decisions[label][o] != "kept" for t in tokens) / len(tokens) for o in objectives}
    return mean, largest, masked


def _kl(tokens: list[TokenScore], labels: list[str]) -> dict[str, float]:
    """k1 estimates on the sampled tokens: `rollout||X` for every series, then `A||B` for every pair in order."""
    sampled = [t for t in tokens if t.sampled]
    if not sampled:
        return {}
    columns: dict[str, list[float]] = {ROLLOUT: [float(t.rollout_logprob or 0.0) for t in sampled]}
    columns.update({label: [t.logprobs[label] for t in sampled] for label in labels})
    names = [ROLLOUT, *labels]
    return {
        f"{a}||{b}": sum(x - y for x, y in zip(columns[a], columns[b], strict=True)) / len(sampled)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


class _Texts:
    """Token id -> its text (the tokenizer's decode of that one id), decoded once per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id])
        return self.cache[token_id]
