"""DSA indexer warm-up: the dense stage fits each indexer to its layer's attention (KL falls, top-k agrees far
above chance on held-out contexts) and touches nothing else; the sparse stage trains under the selection;
a frozen indexer then stays bit-identical through RL."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

from asyncrl.configs.loader import load_config
from asyncrl.configs.schema import IndexerWarmupConfig, LearnerConfig, RunConfig
from asyncrl.jobs.sft import run_sft
from asyncrl.learner.indexer_warmup import (
    DENSE,
    IndexerWarmup,
    capturing,
    check_warmup,
    indexer_parameters,
    run_indexer_warmup,
    selecting,
    topk_agreement,
)
from asyncrl.learner.rl import RLLearner
from asyncrl.learner.sft import micro_batches
from asyncrl.learner.sft_data import Demo
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import build_mtp
from asyncrl.policy.tokenizer import VOCAB_SIZE, build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::asyncrl.learner.consistency.LogprobGapWarning"),  # made-up rollout log-probs
]

K = 8
"""index_topk: every context below is several times longer, so the selection matters at most queries."""
PAD = 0


def contexts(seed: int, count: int, shortest: int = 64, longest: int = 100) -> list[Demo]:
    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    return [Demo([rng.randrange(2, VOCAB_SIZE) for _ in range(n)], [1] * n) for n in lengths]


def glm_model():
    return make_tiny_model("glm_moe_dsa", num_layers=2, index_topk=K, eos_token_id=None)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def warmed():
    """(model before, model after 150 dense steps, the KL of each step)."""
    torch.set_num_threads(1)
    before, model = glm_model(), glm_model()
    warmup = IndexerWarmup(model, IndexerWarmupConfig(steps=150, lr=3e-2), grad_clip=1.0)
    kls = [warmup.dense_step(contexts(step, 8), PAD, None) for step in range(150)]
    return before, model, kls


def test_dense_warmup_lowers_the_kl_and_the_indexer_top_k_agrees_with_attention_far_above_chance(warmed):
    before, model, kls = warmed
    heldout = contexts(10_000, 8)  # seeds the training batches never used
    untrained, chance = topk_agreement(before, heldout, PAD, K)
    trained, chance_again = topk_agreement(model, heldout, PAD, K)
    assert chance == chance_again and 0.15 < chance < 0.25  # k / visible positions, averaged over queries
    # Measured: KL 0.27 -> 0.07 per query (first / last 10 steps); overlap@8 0.20 untrained (chance: 0.20), 0.72 after.
    assert sum(kls[-10:]) / 10 < 0.4 * sum(kls[:10]) / 10
    assert untrained < chance + 0.1
    assert trained > 3 * chance and trained > untrained + 0.3, (untrained, trained, chance)


def test_dense_warmup_moves_every_indexer_parameter_and_nothing_else(warmed):
    before, model, _ = warmed
    old = snapshot(before)
    indexer = {name for name, _ in model.named_parameters() if ".indexer." in name}
    expected = {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"}
    assert {name.split(".indexer.")[1] for name in indexer} == expected
    for name, param in model.named_parameters():
        if name in indexer:
            assert not torch.equal(param, old[name]), f"{name} did not train"
        else:
            assert torch.equal(param, old[name]), f"{name} moved in the dense warm-up"
    assert all(p.grad is None for p in model.parameters())


def test_sparse_stage_selects_k_positions_and_trains_the_policy_on_them():
    model = glm_model()
    mtp = build_mtp(model, seed=1)
    run = RunConfig.model_validate({"sft": {"indexer_warmup": {"sparse_steps": 1}}})
    warmup = IndexerWarmup(model, run.sft.indexer_warmup, grad_clip=1.0)
    demos = contexts(3, 4)
    with capturing(model) as captures, selecting(model, K), torch.no_grad():
        model.get_submodule("model")(input_ids=torch.tensor([demos[0].token_ids]), use_cache=False)
    assert captures and all(c.selected.sum(dim=-1).max() == K for c in captures)
    # The attention the KL targets is the sparse one: nothing outside the selection gets weight.
    assert all(c.attention.masked_fill(c.selected, 0.0).abs().max() == 0.0 for c in captures)

    params = [p for module in (model, mtp) for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    old = snapshot(model)
    loss, kl = warmup.sparse_step(run, mtp, demos, PAD, None, params, optimizer)
    assert loss > 0 and kl > 0
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, old[name])}
    assert {n for n in moved if ".indexer." in n} == {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert "model.layers.0.self_attn.q_a_proj.weight" in moved and "lm_head.weight" in moved
    # The indexers' step is their own optimizer's: the SFT optimizer holds no state for them.
    assert all(not optimizer.state.get(p) for p in indexer_parameters(model))
    assert all(indexer.index_topk == K for indexer in (a.self_attn.indexer for a in model.model.layers) if indexer is not None)


def test_run_indexer_warmup_records_both_stages_and_is_off_by_default():
    model, records = glm_model(), []
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    off = RunConfig()
    assert not run_indexer_warmup(off, model, None, lambda n: contexts(0, n), PAD, None, params, optimizer, records.append)
    run = RunConfig.model_validate({"sft": {"indexer_warmup": {"steps": 2, "sparse_steps": 1, "batch_size": 2, "sparse_index_topk": 4}}})
    assert run_indexer_warmup(run, model, None, lambda n: contexts(len(records), n), PAD, None, params, optimizer, records.append)
    assert [(r["indexer_step"], r["indexer_stage"]) for r in records[:-1]] == [(1, "dense"), (2, "dense"), (3, "sparse")]
    assert records[-1]["indexer_overlap_k"] == 4 and 0 < records[-1]["indexer_overlap_chance"] < 0.2  # 4 of 9-100
    assert model.model.layers[0].self_attn.indexer.index_topk == K  # the stage's top-k is put back
    with pytest.raises(ValueError, match="no DSA indexer"):
        check_warmup(run.sft.indexer_warmup, make_tiny_model("qwen3"))
    check_warmup(off.sft.indexer_warmup, make_tiny_model("qwen3"))  # nothing asked: nothing refused


def _sample(rollout: str, reward: float, tokens: list[int], prompt_length: int) -> Sample:
    mask = [0] * prompt_length + [1] * (len(tokens) - prompt_length)
    versions = [0 if m else UNSAMPLED_VERSION for m in mask]
    return Sample(tokens, mask, [-3.0 if m else 0.0 for m in mask], versions, reward, "g", rollout, "ok")


def test_a_warmed_up_frozen_indexer_stays_bit_identical_through_rl_and_its_push(warmed):
    model = copy.deepcopy(warmed[1])
    config = LearnerConfig(group_size=2, lr=1e-2, mtp_loss_weight=0.3, freeze_indexer=True)
    learner = RLLearner(config, model, build_tokenizer(), build_mtp(model, seed=1))
    warmed_indexer = {name: p.detach().clone() for name, p in learner.model.named_parameters() if ".indexer." in name}
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in indexer_parameters(learner.model))
    pushed_before = learner.state_dict_for_push()
    a, b = contexts(7, 2, 40, 48)  # 40+ tokens against index_topk 8: the selection shapes most queries
    assert learner.train_step(Batch([[_sample("a", 1.0, a.token_ids, 20), _sample("b", 0.0, b.token_ids, 20)]])).stepped
    pushed = learner.state_dict_for_push()
    for name, value in warmed_indexer.items():
        assert torch.equal(dict(learner.model.named_parameters())[name], value), f"{name} moved in RL"
        assert torch.equal(pushed[name], value), f"the push carries a changed {name}"
    assert any(not torch.equal(pushed[n], pushed_before[n]) for n in pushed if ".indexer." not in n)  # the rest trained


def test_asyncrl_sft_runs_the_warmup_after_its_loop_and_saves_the_warmed_indexer(tmp_path):
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16, index_topk=64)
    overrides = [f"policy.tiny.{k}={v}" for k, v in shape.items()] + [
        f"runs_dir={tmp_path}", "sft.max_steps=2", "sft.batch_size=8", "sft.eval_every=2", "sft.stop_at_accuracy=null",
        "eval.num_problems=2", "eval.max_tokens=3", "logging.wandb=disabled", "logging.progress=false", "sft.tool_demo_fraction=0.5",
    ]  # fmt: skip
    warmup = ["sft.indexer_warmup.steps=3", "sft.indexer_warmup.sparse_steps=2", "sft.indexer_warmup.batch_size=8"]
    result = run_sft(load_config(None, [*overrides, *warmup, "sft.indexer_warmup.sparse_index_topk=4", "name=t"]))
    records = [json.loads(line) for line in (tmp_path / "t" / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "indexer_stage" in r]
    assert [(r["step"], r["indexer_stage"]) for r in steps] == [(2, "dense")] * 3 + [(2, "sparse")] * 2
    assert all(r["indexer_kl"] > 0 for r in steps) and all(r["sparse_loss"] > 0 for r in steps[3:])
    assert [r["step"] for r in records if "eval_accuracy" in r] == [2, 2]  # the warmed-up checkpoint is scored again
    saved = json.loads((result.checkpoint / "config.json").read_text())
    assert saved["index_topk"] == 64 and saved["asyncrl"]["indexer_warmup"]["steps"] == 3
    # SFT alone cannot move an indexer (no gradient reaches it): the warmed one differs from its initialisation.
    config = load_config(None, overrides)
    initial = build_policy(config.policy, config.seed)[0].state_dict()
    warmed = AutoModelForCausalLM.from_pretrained(str(result.checkpoint)).state_dict()
    assert all(not torch.equal(warmed[n], initial[n]) for n in warmed if ".indexer." in n)


def test_packed_rows_keep_each_conversation_to_its_own_keys():
    model, (first, second) = glm_model(), contexts(5, 2, 20, 30)
    (batch,) = micro_batches([first, second], PAD, len(first.token_ids) + len(second.token_ids))
    with capturing(model) as captures, selecting(model, DENSE), torch.no_grad():
        model.get_submodule("model")(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    boundary = len(max(first, second, key=lambda d: len(d.token_ids)).token_ids)  # pack lays the longer one first
    for capture in captures:
        assert not capture.selected[0, boundary:, :boundary].any() and capture.selected[0, boundary:, boundary:].any()
        assert capture.attention[0, boundary:, :boundary].abs().max() == 0.0
    assert IndexerWarmup(model, IndexerWarmupConfig(steps=1), grad_clip=1.0).dense_step([first, second], PAD, 64) > 0
