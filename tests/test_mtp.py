"""The MTP layer: structure, shapes, the depth recurrence, and that its auxiliary loss can learn."""

from __future__ import annotations

import pytest
import torch

from asyncrl.configs.schema import TinyModelConfig
from asyncrl.policy.mtp import build_mtp, draft_hidden, mtp_logits, mtp_loss, policy_hidden_and_logits
from asyncrl.policy.tiny import build_tiny_model

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)


def draft_step(model, mtp, *args):
    """One depth's logits and output, as a drafting engine reads them: the head after the shared-head norm."""
    hidden = draft_hidden(model, mtp, *args)
    return model.get_submodule("lm_head")(mtp.shared_head.norm(hidden)), hidden


def small_policy(arch: str):
    model = build_tiny_model(TinyModelConfig(arch=arch, **SMALL), seed=0).eval()
    return model, build_mtp(model, seed=1).eval()


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_structure_follows_the_policy_family(arch):
    model, mtp = small_policy(arch)
    assert mtp.layer_index == model.config.num_hidden_layers == 2
    assert type(mtp.block) is type(model.model.layers[-1])
    assert mtp.eh_proj.weight.shape == (32, 64)
    if arch == "glm_moe_dsa":
        # Like GLM-5's and DeepSeek-V3's MTP layers: a MoE layer with its own DSA indexer.
        assert mtp.config.mlp_layer_types[-1] == "sparse" and hasattr(mtp.block.mlp, "experts")
        assert mtp.block.self_attn.indexer is not None
    # The embedding and LM head are the policy's, not parameters of the MTP layer.
    assert not any("embed" in name or "lm_head" in name for name, _ in mtp.named_parameters())


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_shapes_and_depth_recurrence(arch):
    model, mtp = small_policy(arch)
    ids = torch.randint(20, 100, (3, 11))
    with torch.no_grad():
        hidden, logits = policy_hidden_and_logits(model, ids)
        depths = mtp_logits(model, mtp, hidden, ids, None, depth=3)
        assert hidden.shape == (3, 11, 32) and logits.shape == (3, 11, 128)
        assert [d.shape for d in depths] == [(3, 11, 128)] * 3
        # Depth 2 is the same layer applied again to depth 1's output and the token one further on.
        positions = torch.arange(11).expand(3, -1)
        first, h1 = draft_step(model, mtp, hidden, torch.cat([ids[:, 1:], ids[:, :1] * 0], 1), positions)
        second, _ = draft_step(model, mtp, h1, torch.cat([ids[:, 2:], ids[:, :2] * 0], 1), positions)
    torch.testing.assert_close(first, depths[0])
    torch.testing.assert_close(second, depths[1])


def test_drafts_at_a_position_do_not_depend_on_later_tokens():
    model, mtp = small_policy("glm_moe_dsa")
    ids = torch.randint(20, 100, (1, 12))
    changed = ids.clone()
    changed[0, 9:] = 5
    with torch.no_grad():
        a = mtp_logits(model, mtp, policy_hidden_and_logits(model, ids)[0], ids, None, 1)[0]
        b = mtp_logits(model, mtp, policy_hidden_and_logits(model, changed)[0], changed, None, 1)[0]
    # Depth 1 at position i reads tokens up to i+1, so positions 0..7 are unaffected.
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8], b[0, 8])


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_aux_loss_decreases_when_overfitting_a_batch(arch):
    torch.manual_seed(0)
    model, mtp = small_policy(arch)
    mtp.train()
    # Counting sequences: token t+1 follows from token t, which the MTP layer reads directly.
    ids = torch.tensor([[20 + 3 * row + i for i in range(10)] for row in range(4)])
    mask = torch.ones(4, 10)
    with torch.no_grad():
        hidden = policy_hidden_and_logits(model, ids)[0]
    # The LM head is shared with the policy and trains with it; frozen at its random init it caps
    # the logit scale and the loss could barely move.
    optimizer = torch.optim.Adam(list(mtp.parameters()) + list(model.lm_head.parameters()), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = mtp_loss(model, mtp, hidden, ids, None, mask, depth=2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_loss_mask_selects_the_trained_targets():
    model, mtp = small_policy("qwen3")
    ids = torch.randint(20, 40, (2, 8))
    hidden = policy_hidden_and_logits(model, ids)[0]
    mask = torch.zeros(2, 8)
    mask[0, 5] = 1  # only token 5 of row 0: depth 1 predicts it from position 3
    with torch.no_grad():
        loss = mtp_loss(model, mtp, hidden, ids, None, mask, depth=1)
        logits = mtp_logits(model, mtp, hidden, ids, None, 1)[0]
    expected = torch.nn.functional.cross_entropy(logits[0, 3:4], ids[0, 5:6])
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_incremental_drafting_with_a_cache_matches_the_full_pass(arch):
    from transformers import DynamicCache

    model, mtp = small_policy(arch)
    ids = torch.randint(20, 100, (1, 10))
    following = torch.cat([ids[:, 1:], ids[:, :1] * 0], 1)
    positions = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        hidden = policy_hidden_and_logits(model, ids)[0]
        full = mtp_logits(model, mtp, hidden, ids, None, 1)[0]
        cache = DynamicCache(config=mtp.config)
        # Prefill positions 0..5, then draft one position at a time, as a decoding engine would.
        steps = [draft_step(model, mtp, hidden[:, :6], following[:, :6], positions[:, :6], torch.ones(1, 6), cache)[0]]
        for t in range(6, 9):
            step = draft_step(
                model, mtp, hidden[:, t : t + 1], following[:, t : t + 1], positions[:, t : t + 1],
                torch.ones(1, t + 1), cache,
            )  # fmt: skip
            steps.append(step[0])
    torch.testing.assert_close(torch.cat(steps, 1), full[:, :9], rtol=1e-5, atol=1e-5)
