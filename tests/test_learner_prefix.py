"""Shared-prefix scoring (learner/prefix.py): the same step for fewer tokens.

Rows that begin alike (a GRPO group's prompt) are scored in two passes, the prefix once and every
row's suffix against its cache. The question here is whether that changes anything but the cost:
the split must put every token back where it was, the step must equal the one-pass step (loss,
gradient norm, weights after it, the MTP loss) on both families, micro-batches must keep their
token cap, and a family that cannot score through a cache must fall back to whole rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model
from learner_steps import batch_for, record_gradients

from asyncrl.configs.schema import LearnerConfig
from asyncrl.learner.batch import Row, _collate_shared, micro_batches
from asyncrl.learner.prefix import prefix_groups, saved_fraction, sharing_refusal, split_rows
from asyncrl.learner.rl import RLLearner
from asyncrl.policy.mtp import build_mtp
from asyncrl.policy.tokenizer import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-6, on one thread


def row(prompt: list[int], completion: list[int], env: list[int] = (), more: list[int] = ()) -> Row:
    tokens = prompt + completion + list(env) + list(more)
    mask = [0] * len(prompt) + [1] * len(completion) + [0] * len(env) + [1] * len(more)
    return Row(tokens, mask, [0.0] * len(tokens), 1.0, [1.0] * len(tokens))


def test_rows_with_one_prompt_share_what_they_all_begin_with():
    rows = [
        row([3, 4, 5], [10, 11, 12]),
        row([7, 8], [10]),
        row([3, 4, 5], [10, 11, 13]),  # the first two sampled tokens agree too: shared as well
        row([3, 4, 5], [10, 11, 12, 14]),
        row([7, 8], [20, 21], env=[30], more=[22]),
        row([9], [10, 11]),  # alone: all but its last token
    ]
    assert prefix_groups(rows) == [(5, [0, 2, 3]), (2, [1, 4]), (2, [5])]
    assert saved_fraction(prefix_groups(rows), rows) == pytest.approx((5 * 2 + 2 * 1) / sum(len(r.token_ids) for r in rows))
    # A row that is all prompt (nothing sampled) keeps its last token for the suffix pass.
    assert prefix_groups([row([3, 4, 5], []), row([3, 4, 5], [])]) == [(2, [0, 1])]


def test_the_split_puts_every_token_back_where_it_was():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    rows = [row(rng.choice(prompts), [rng.randrange(3, 100) for _ in range(rng.randrange(1, 9))]) for _ in range(40)]
    groups = prefix_groups(rows)
    split = split_rows(groups, rows, pad_token_id=0)
    width = max(len(r.token_ids) for r in rows)
    assert split.gather.shape == (len(rows), width) and split.prefix_ids.shape[0] == len(groups)
    tokens = torch.cat([split.prefix_ids.flatten(), split.suffix_ids.flatten()])[split.gather]
    for i, r in enumerate(rows):
        assert tokens[i, : len(r.token_ids)].tolist() == r.token_ids
        length = int(split.prefix_len[i])
        assert split.suffix_ids[i, : len(r.token_ids) - length].tolist() == r.token_ids[length:]
        assert int(split.suffix_mask[i].sum()) == len(r.token_ids) - length >= 1
    assert int(split.prefix_mask.sum()) == sum(length for length, _ in groups)


@pytest.mark.parametrize(("arch", "mtp"), [("qwen3", False), ("qwen3", True), ("glm_moe_dsa", False)])
def test_a_step_through_shared_prefixes_is_the_step_over_whole_rows(arch, mtp):
    # index_topk 4: the DSA indexer really chooses among a prompt's positions.
    shape = {"index_topk": 4} if arch == "glm_moe_dsa" else {}

    def learner(share: bool) -> RLLearner:
        model = make_tiny_model(arch, **shape)
        config = LearnerConfig(group_size=4, lr=1e-3, weight_decay=0.0, share_prefixes=share, mtp_loss_weight=0.3 if mtp else 0.0)
        return RLLearner(config, model, build_tokenizer(), build_mtp(model, seed=1) if mtp else None)

    whole, shared = learner(False), learner(True)
    assert shared.share_prefixes and not whole.share_prefixes
    # The gradients the optimizer gets are compared (Adam's first step divides each by its own size, so the
    # weights after it would magnify rounding in gradients near zero).
    gradients = [record_gradients(whole), record_gradients(shared)]
    a, b = whole.train_step(batch_for(whole)), shared.train_step(batch_for(shared))
    assert a.metrics["prefix_skipped_tokens"] == 0
    assert b.metrics["prefix_skipped_tokens"] == 3 * 7 + 3 * 5  # each group's prompt computed once, not four times
    assert b.metrics["computed_tokens"] == a.metrics["computed_tokens"]
    assert b.metrics["computed_trainable_tokens"] == a.metrics["computed_trainable_tokens"]
    assert b.loss == pytest.approx(a.loss, abs=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert b.metrics["abs_logp_diff"] == pytest.approx(a.metrics["abs_logp_diff"], abs=1e-6)
    if mtp:
        assert a.metrics["mtp_loss"] > 0 and b.metrics["mtp_loss"] == pytest.approx(a.metrics["mtp_loss"], rel=1e-5)
    (of_whole,), (of_shared,) = gradients
    assert of_whole.keys() == of_shared.keys() and len(of_whole) > 5
    for name, gradient in of_whole.items():
        torch.testing.assert_close(of_shared[name], gradient, atol=1e-7, rtol=1e-5, msg=name)


def test_micro_batches_keep_their_token_cap_and_share_within_it():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 100) for _ in range(10)] for _ in range(4)]
    rows = [row(prompt, [rng.randrange(3, 100) for _ in range(rng.randrange(1, 6))]) for prompt in prompts for _ in range(8)]
    batches = micro_batches(rows, pad_token_id=0, max_tokens=64, share_prefixes=True)
    assert sum(b.input_ids.shape[0] for b in batches) == len(rows)
    for batch in batches:
        assert batch.input_ids.numel() <= 64
        assert batch.prefix is not None  # 4 rows of 11-15 tokens share 10: well past MIN_SAVED_FRACTION
        first = {tuple(ids[:10].tolist()) for ids in batch.input_ids}
        assert len(first) == 1  # a prompt's rows are cut into pieces; pieces of different prompts may not share
    # Rows that share nothing go through whole.
    alone = [row([3 + i, 50], [10, 11, 12, 13]) for i in range(6)]
    assert all(b.prefix is None for b in micro_batches(alone, 0, 8192, share_prefixes=True))


def test_a_one_token_row_is_never_scored_through_an_empty_prefix():
    # Length buckets keep a one-token row apart from longer ones; were it beside rows that share a
    # prompt, its empty prefix would attend to nothing (NaN in the backward pass), so the batch goes whole.
    with_a_token = [row([3, 4, 5], [10, 11]), row([3, 4, 5], [12, 13]), row([7], [])]
    assert prefix_groups(with_a_token)[1] == (0, [2])
    assert _collate_shared(with_a_token, pad_token_id=0).prefix is None
    assert _collate_shared(with_a_token[:2], pad_token_id=0).prefix is not None


def test_a_family_that_scores_otherwise_through_a_cache_falls_back_to_whole_rows(monkeypatch):
    from transformers import DynamicCache

    # A cache whose rows are not the ones selected: each row would attend to the first prefix.
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda cache, indices: DynamicCache.batch_repeat_interleave(cache, 1))
    model = make_tiny_model("qwen3")
    assert "changes its logits" in (sharing_refusal(model) or "") or "failed" in (sharing_refusal(model) or "")
    with pytest.warns(UserWarning, match="learner.share_prefixes: .*scoring whole rows"):
        learner = RLLearner(LearnerConfig(group_size=4), model, build_tokenizer())
    assert not learner.share_prefixes


@pytest.mark.parametrize("setting", [{"routing_replay": True}, {"gradient_checkpointing": True}, {"share_prefixes": False}])
def test_settings_that_score_whole_rows_turn_sharing_off(setting, monkeypatch):
    checked = []
    monkeypatch.setattr("asyncrl.learner.rl.sharing_refusal", lambda policy: checked.append(policy))
    learner = RLLearner(LearnerConfig(group_size=4, **setting), make_tiny_model("qwen3"), build_tokenizer())
    assert not learner.share_prefixes and not checked
