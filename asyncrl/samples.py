"""From completed trajectories to the samples the learner trains on, and from GRPO groups of them to a `Batch`.

A multi-turn rollout is one token sequence as long as every turn's prompt starts with the exact
tokens of what came before (earlier prompt plus sampled completion, bit for bit): the new tokens
between two completions are the environment's (tool results, user messages) and are masked out.
When a prompt does not extend any earlier sequence, the agent rewrote its context (dropped or edited
messages, retried a turn): the trajectory forks, the turn starts a new sample, and every sample
shares the trajectory's reward. A later turn continues whichever earlier sequence it extends, so an
agent that alternates between two contexts yields two samples, not one per turn.

Every sampled token carries its turn's temperature, so a sample whose turns were drawn at different
temperatures is still scored exactly, token by token.

KV provenance (`Sample.kv_versions`) is kept when any turn recorded it. A turn that did not (an engine
that records none, a turn stored before turns carried it) gives its sampling versions instead: the KV a
token attended to is never newer than the weights that sampled it, so these are the newest versions it
can have had. That is the optimistic choice: under `learner.staleness_by: kv` such a token counts as
stale as its sampling version says, never more.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, Trajectory, Turn


def _truncation(turn: Turn) -> tuple[int, float]:
    """(top_k, top_p) the turn's tokens were drawn under; (0, 1.0), none, for greedy turns (the engines report
    their raw log-probs) and turns that recorded no options."""
    if not turn.temperature:
        return 0, 1.0
    return turn.top_k or 0, turn.top_p if turn.top_p is not None else 1.0


def trajectory_to_samples(trajectory: Trajectory) -> list[Sample]:
    """The samples of a finished trajectory, one per fork, in the order the forks began.

    An aborted trajectory has nothing to train on and gives none; a running one is an error.
    """
    if trajectory.status == "aborted":
        return []
    if trajectory.status == "running" or trajectory.reward is None:
        raise ValueError(f"rollout {trajectory.rollout_id!r} is not finished (status {trajectory.status}); no samples yet")
    samples: list[Sample] = []
    # Stores written before turns carried their temperature give samples without one (the learner's default).
    recorded = any(turn.temperature is not None for turn in trajectory.turns)
    routed = any(turn.routes is not None for turn in trajectory.turns)
    provenanced = any(turn.kv_versions is not None for turn in trajectory.turns)
    truncating = any(_truncation(turn) != (0, 1.0) for turn in trajectory.turns)
    for turn in trajectory.turns:
        prompt = turn.prompt_token_ids
        sample = _longest_extended(samples, prompt)
        if sample is None:
            sample = Sample(
                token_ids=[], loss_mask=[], logprobs=[], versions=[],
                reward=trajectory.reward, group_id=trajectory.group_id, rollout_id=trajectory.rollout_id,
                status=trajectory.status, task=trajectory.task, branch=len(samples), temperatures=[] if recorded else None,
                token_turns=[], routes=[] if routed else None,
                top_ks=[] if truncating else None, top_ps=[] if truncating else None,
                kv_versions=[] if provenanced else None,
            )  # fmt: skip
            samples.append(sample)
        unsampled = len(prompt) - len(sample.token_ids)
        sampled = len(turn.completion_token_ids)
        sample.token_ids += prompt[len(sample.token_ids) :] + turn.completion_token_ids
        sample.loss_mask += [0] * unsampled + [1] * sampled
        sample.logprobs += [0.0] * unsampled + turn.logprobs
        sample.versions += [UNSAMPLED_VERSION] * unsampled + turn.versions
        if sample.kv_versions is not None:
            sample.kv_versions += [UNSAMPLED_VERSION] * unsampled + (turn.kv_versions if turn.kv_versions is not None else turn.versions)
        if sample.temperatures is not None:
            sample.temperatures += [None] * unsampled + [turn.temperature] * sampled
        if sample.top_ks is not None and sample.top_ps is not None:
            top_k, top_p = _truncation(turn)
            sample.top_ks += [0] * unsampled + [top_k] * sampled
            sample.top_ps += [1.0] * unsampled + [top_p] * sampled
        assert sample.token_turns is not None
        sample.token_turns += [turn.index] * (unsampled + sampled)
        if sample.routes is not None:
            routes: list[list[list[int]] | None] = [None] * unsampled
            routes += turn.routes if turn.routes is not None else [None] * sampled
            sample.routes += routes
        sample.turn_indices.append(turn.index)
        sample.truncated = turn.finish_reason == "length"
    return samples


def _longest_extended(samples: list[Sample], prompt: list[int]) -> Sample | None:
    """The sample whose tokens are the longest exact prefix of `prompt`; the latest one on a tie."""
    best = None
    for sample in samples:
        n = len(sample.token_ids)
        if n <= len(prompt) and prompt[:n] == sample.token_ids and (best is None or n >= len(best.token_ids)):
            best = sample
    return best


def batch_of(groups: Sequence[Sequence[Trajectory]], crash_statuses: Sequence[str]) -> Batch:
    """The learner's batch for whole groups of finished trajectories: every rollout appears, so every
    rollout gets an account.

    A trajectory that gives no sample has nothing to train on (aborted, or the episode ended before
    its first model call); it goes in as an empty placeholder that selection drops: as a crash when
    its status says so, otherwise as aborted.
    """
    return Batch([[s for t in group for s in trajectory_to_samples(t) or [_placeholder(t, crash_statuses)]] for group in groups])


def _placeholder(trajectory: Trajectory, crash_statuses: Sequence[str]) -> Sample:
    status = trajectory.status if trajectory.status in crash_statuses else "aborted"
    return Sample(
        token_ids=[], loss_mask=[], logprobs=[], versions=[], reward=trajectory.reward or 0.0,
        group_id=trajectory.group_id, rollout_id=trajectory.rollout_id, status=status, task=trajectory.task,
    )  # fmt: skip
