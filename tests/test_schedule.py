"""Learning-rate schedules (learner/schedule.py) and the no-weight-decay groups of learner/optim.py.

Factors are checked against numbers computed by hand from the schedule's formula; the optimizers are
real ones (torch's AdamW, the project's CombinedOptimizer) on a small transformers Llama.
"""

from __future__ import annotations

import io
import math
from itertools import pairwise

import pydantic
import pytest
import torch
import transformers

from asyncrl.configs.learner import LearnerConfig, ScheduleConfig
from asyncrl.configs.schema import OptimizerConfig
from asyncrl.learner.optim import CombinedOptimizer, build_optimizer
from asyncrl.learner.schedule import build_scheduler, lr_factor
from asyncrl.policy.mtp import build_mtp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL = ("norms", "biases", "embeddings")


def llama(*, tied: bool = False, bias: bool = True, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=tied, attention_bias=bias,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def names_of(model: torch.nn.Module, *extra: torch.nn.Module) -> dict[int, str]:
    named = [*model.named_parameters(), *((f"mtp.{n}", p) for m in extra for n, p in m.named_parameters())]
    names: dict[int, str] = {}
    for name, param in named:
        names.setdefault(id(param), name)
    return names


def decay_by_name(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *extra: torch.nn.Module) -> dict[str, float]:
    """name -> the weight decay of the group holding the parameter (each parameter in one group only)."""
    names = names_of(model, *extra)
    out: dict[str, float] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert names[id(param)] not in out
            out[names[id(param)]] = group["weight_decay"]
    return out


def layer_names(*suffixes: str, prefix: str = "model.layers") -> set[str]:
    return {f"{prefix}.{i}.{s}" for i in range(2) for s in suffixes}


NORMS = {"model.norm.weight"} | layer_names("input_layernorm.weight", "post_attention_layernorm.weight")
BIASES = layer_names(*(f"self_attn.{p}_proj.bias" for p in "qkvo"))
MATRICES = layer_names(*(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


# -- lr_factor ------------------------------------------------------------------------------------


def test_warmup_rises_from_lr_over_warmup_steps_to_lr_then_stays_constant():
    schedule = ScheduleConfig(warmup_steps=4)
    assert [lr_factor(schedule, s) for s in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert lr_factor(schedule, 10**6) == 1.0


def test_constant_without_warmup_is_one_at_every_step():
    schedule = ScheduleConfig()
    assert [lr_factor(schedule, s) for s in (0, 1, 7, 10**6)] == [1.0, 1.0, 1.0, 1.0]


def test_linear_decay_after_warmup_reaches_the_floor_at_decay_steps_and_stays():
    schedule = ScheduleConfig(kind="linear", warmup_steps=2, decay_steps=12, min_lr_ratio=0.1)
    # Warm-up: 1/2, 2/2. Decay from step 2 (p = 0) to step 12 (p = 1): 0.1 + 0.9 (1 - p).
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.82, 7: 0.55, 11: 0.19, 12: 0.1, 13: 0.1, 1000: 0.1}
    for step, factor in expected.items():
        assert lr_factor(schedule, step) == pytest.approx(factor, abs=1e-12), step


def test_cosine_decay_without_warmup_matches_the_half_cosine():
    schedule = ScheduleConfig(kind="cosine", decay_steps=10)
    # (1 + cos(pi p)) / 2 at p = s / 10: cos(36 deg) = 0.80901699437.
    expected = {0: 1.0, 2: 0.9045084971874737, 5: 0.5, 8: 0.09549150281252629, 10: 0.0, 11: 0.0, 500: 0.0}
    for step, factor in expected.items():
        assert lr_factor(schedule, step) == pytest.approx(factor, abs=1e-12), step


def test_cosine_decay_after_warmup_floors_at_min_lr_ratio():
    schedule = ScheduleConfig(kind="cosine", warmup_steps=2, decay_steps=12, min_lr_ratio=0.2)
    # p = (s - 2) / 10; 0.2 + 0.8 (1 + cos(pi p)) / 2.
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 7: 0.6, 4: 0.2 + 0.4 * (1 + 0.8090169943749475), 12: 0.2, 40: 0.2}
    for step, factor in expected.items():
        assert lr_factor(schedule, step) == pytest.approx(factor, abs=1e-12), step
    # Monotone from the peak down to the floor.
    factors = [lr_factor(schedule, s) for s in range(1, 14)]
    assert all(a >= b for a, b in pairwise(factors))


def test_a_negative_step_is_refused():
    with pytest.raises(ValueError, match="step -1"):
        lr_factor(ScheduleConfig(), -1)


# -- config validation ------------------------------------------------------------------------------


def test_a_decaying_schedule_without_decay_steps_is_refused_naming_decay_steps():
    with pytest.raises(pydantic.ValidationError, match="decay_steps"):
        LearnerConfig(schedule={"kind": "cosine"})
    with pytest.raises(pydantic.ValidationError, match="decay_steps"):
        LearnerConfig(schedule={"kind": "linear"})


def test_decay_steps_must_exceed_warmup_steps_and_no_decay_kinds_are_checked():
    with pytest.raises(pydantic.ValidationError, match=r"decay_steps \(4\) must be greater than warmup_steps \(4\)"):
        LearnerConfig(schedule={"kind": "linear", "warmup_steps": 4, "decay_steps": 4})
    with pytest.raises(pydantic.ValidationError, match="no_decay"):
        LearnerConfig(no_decay=["weights"])
    config = LearnerConfig(schedule={"kind": "cosine", "decay_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1})
    assert (config.schedule.kind, config.schedule.decay_steps, config.schedule.warmup_steps) == ("cosine", 100, 10)
    assert LearnerConfig().no_decay == list(ALL)
    assert LearnerConfig().schedule == ScheduleConfig(kind="constant", warmup_steps=0)


# -- build_scheduler ------------------------------------------------------------------------------


def step_with_ones(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int | None = None) -> None:
    """One optimizer step on gradients of ones, or of random values drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for param in params:
        param.grad = torch.ones_like(param) if generator is None else torch.randn(param.shape, generator=generator)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_scheduler_on_adamw_sets_each_steps_rate():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    params = list(layer.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    scheduler = build_scheduler(optimizer, ScheduleConfig(kind="linear", warmup_steps=2, decay_steps=6))
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        step_with_ones(optimizer, params)
        scheduler.step()
    # Warm-up 0.05, 0.1; decay from step 2: 0.1 (1 - (s - 2) / 4).
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0], abs=1e-12)
    assert scheduler.get_last_lr() == pytest.approx([0.0], abs=1e-12)


def muon_learner(seed: int = 0, *, adamw_lr: float | None = 0.004):
    model = llama(seed=seed)
    params = list(model.parameters())
    config = OptimizerConfig(type="muon", adamw_lr=adamw_lr)
    optimizer = build_optimizer(config, model, params, lr=0.02, weight_decay=0.1, no_decay=ALL)
    return model, params, optimizer


def test_scheduler_on_the_combined_muon_optimizer_scales_every_group_from_its_own_base_rate():
    _, params, optimizer = muon_learner()
    assert isinstance(optimizer, CombinedOptimizer)
    schedule = ScheduleConfig(kind="cosine", warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    base = [0.02, 0.004, 0.004]  # muon matrices, AdamW with decay (lm_head), AdamW without
    assert [g["lr"] for g in optimizer.param_groups] == base
    scheduler = build_scheduler(optimizer, schedule)
    inner = [*optimizer.optimizers["muon"].param_groups, *optimizer.optimizers["adamw"].param_groups]
    for step in range(8):
        factor = lr_factor(schedule, step)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([b * factor for b in base], abs=1e-15), step
        assert [g["lr"] for g in inner] == pytest.approx([b * factor for b in base], abs=1e-15), step
        step_with_ones(optimizer, params)
        scheduler.step()
    assert [g["lr"] for g in inner] == pytest.approx([b * 0.1 for b in base], abs=1e-15)


def round_trip(state: dict) -> dict:
    """`state` through torch.save and torch.load(weights_only=True), as a learner checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_optimizer_and_scheduler_state_resume_in_a_fresh_learner(kind):
    schedule = ScheduleConfig(kind="linear", warmup_steps=2, decay_steps=8, min_lr_ratio=0.25)

    def learner():
        model = llama()
        params = list(model.parameters())
        optimizer = build_optimizer(OptimizerConfig(type=kind), model, params, lr=0.01, weight_decay=0.1, no_decay=ALL)
        return model, params, optimizer, build_scheduler(optimizer, schedule)

    model, params, optimizer, scheduler = learner()
    for step in range(3):
        step_with_ones(optimizer, params, seed=step)
        scheduler.step()
    saved = round_trip({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})
    assert saved["scheduler"]["last_epoch"] == 3
    fresh_model, fresh_params, fresh_optimizer, fresh_scheduler = learner()
    fresh_model.load_state_dict(model.state_dict())
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh_scheduler.load_state_dict(saved["scheduler"])
    assert [g["lr"] for g in fresh_optimizer.param_groups] == pytest.approx([0.01 * lr_factor(schedule, 3)] * len(optimizer.param_groups))
    assert [g["weight_decay"] for g in fresh_optimizer.param_groups] == [g["weight_decay"] for g in optimizer.param_groups]
    for step in range(3, 9):
        # Random gradients: the two learners' weights stay equal only if the moments were restored.
        step_with_ones(optimizer, params, seed=step)
        step_with_ones(fresh_optimizer, fresh_params, seed=step)
        scheduler.step()
        fresh_scheduler.step()
        lrs = [g["lr"] for g in fresh_optimizer.param_groups]
        assert lrs == [g["lr"] for g in optimizer.param_groups]
        assert lrs == pytest.approx([0.01 * lr_factor(schedule, step + 1)] * len(lrs), abs=1e-15)
    if kind == "muon":  # loading replaced the inner group dicts: the scheduler must still reach them
        inner = [g["lr"] for o in fresh_optimizer.optimizers.values() for g in o.param_groups]
        assert inner == pytest.approx([0.01 * 0.25] * len(inner), abs=1e-15)
    for name, param in model.named_parameters():
        torch.testing.assert_close(dict(fresh_model.named_parameters())[name], param, rtol=0, atol=0)


# -- no_decay -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_adamw_exempts_norms_biases_and_the_embedding(tied):
    model = llama(tied=tied)
    optimizer = build_optimizer(OptimizerConfig(), model, list(model.parameters()), lr=1e-3, weight_decay=0.1, no_decay=ALL)
    assert isinstance(optimizer, torch.optim.AdamW)
    decay = decay_by_name(optimizer, model)
    exempt = NORMS | BIASES | {"model.embed_tokens.weight"}
    decayed = MATRICES | (set() if tied else {"lm_head.weight"})
    assert set(decay) == exempt | decayed
    assert {n for n, wd in decay.items() if wd == 0.0} == exempt
    assert {n for n, wd in decay.items() if wd == 0.1} == decayed
    if tied:  # the head is the embedding's tensor: it takes no decay either
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # The decayed group first, each in the model's parameter order.
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(decayed), len(exempt)]


@pytest.mark.parametrize("tied", [False, True])
def test_muon_exempts_adamws_norms_biases_and_embedding_and_keeps_decay_on_its_matrices(tied):
    model = llama(tied=tied)
    optimizer = build_optimizer(OptimizerConfig(type="muon"), model, list(model.parameters()), lr=0.02, weight_decay=0.1, no_decay=ALL)
    assert isinstance(optimizer, CombinedOptimizer)
    muon = decay_by_name(optimizer.optimizers["muon"], model)
    adamw = decay_by_name(optimizer.optimizers["adamw"], model)
    assert muon == dict.fromkeys(MATRICES, 0.1)
    expected = dict.fromkeys(NORMS | BIASES | {"model.embed_tokens.weight"}, 0.0)
    if not tied:
        expected["lm_head.weight"] = 0.1
    assert adamw == expected
    assert len(optimizer.optimizers["adamw"].param_groups) == (2 if not tied else 1)


def test_the_mtp_layers_parameters_are_classified_alike():
    model = llama()
    mtp = build_mtp(model, seed=1)
    seen = {id(p) for p in model.parameters()}
    params = [*model.parameters(), *(p for p in mtp.parameters() if id(p) not in seen)]
    optimizer = build_optimizer(
        OptimizerConfig(type="muon"), model, params, lr=0.02, weight_decay=0.1, extra=[mtp], no_decay=ALL
    )  # fmt: skip
    decay = decay_by_name(optimizer, model, mtp)
    mtp_exempt = {"mtp.enorm.weight", "mtp.hnorm.weight", "mtp.shared_head.norm.weight"}
    mtp_exempt |= {f"mtp.block.{s}" for s in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    mtp_exempt |= {f"mtp.block.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert {n for n, wd in decay.items() if n.startswith("mtp.") and wd == 0.0} == mtp_exempt
    assert decay["mtp.eh_proj.weight"] == 0.1
    assert decay["mtp.block.mlp.down_proj.weight"] == 0.1


@pytest.mark.parametrize(
    ("kinds", "exempt"),
    [(["norms"], NORMS), (["biases"], BIASES), (["embeddings"], {"model.embed_tokens.weight"})],
)
def test_each_kind_exempts_only_its_own(kinds, exempt):
    model = llama()
    optimizer = build_optimizer(OptimizerConfig(), model, list(model.parameters()), lr=1e-3, weight_decay=0.1, no_decay=kinds)
    decay = decay_by_name(optimizer, model)
    assert {n for n, wd in decay.items() if wd == 0.0} == exempt
    assert len(decay) == len(NORMS | BIASES | MATRICES) + 2  # + embedding and head


def test_layernorm_weights_count_as_norms_and_their_biases_as_biases():
    model = llama()
    model.model.norm = torch.nn.LayerNorm(32)  # a norm with a bias
    params = list(model.parameters())
    only_norms = decay_by_name(build_optimizer(OptimizerConfig(), model, params, lr=1e-3, weight_decay=0.1, no_decay=["norms"]), model)
    assert only_norms["model.norm.weight"] == 0.0 and only_norms["model.norm.bias"] == 0.1
    only_biases = decay_by_name(build_optimizer(OptimizerConfig(), model, params, lr=1e-3, weight_decay=0.1, no_decay=["biases"]), model)
    assert only_biases["model.norm.weight"] == 0.1 and only_biases["model.norm.bias"] == 0.0


def test_without_no_decay_the_optimizers_are_as_before():
    model = llama()
    params = list(model.parameters())
    adamw = build_optimizer(OptimizerConfig(), model, params, lr=1e-3, weight_decay=0.1)
    assert type(adamw) is torch.optim.AdamW and len(adamw.param_groups) == 1
    assert adamw.param_groups[0]["params"] == params and adamw.param_groups[0]["weight_decay"] == 0.1
    muon = build_optimizer(OptimizerConfig(type="muon"), model, params, lr=0.02, weight_decay=0.1)
    assert len(muon.optimizers["adamw"].param_groups) == 1
    assert {g["weight_decay"] for g in muon.param_groups} == {0.1}


def test_an_unknown_no_decay_kind_is_refused():
    model = llama()
    with pytest.raises(ValueError, match="unknown \\['norm'\\]"):
        build_optimizer(OptimizerConfig(), model, list(model.parameters()), lr=1e-3, weight_decay=0.1, no_decay=["norm"])


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_a_zero_gradient_step_decays_matrices_and_leaves_exempt_parameters_as_they_were(kind):
    """AdamW's update of a zero gradient is 0 (zero moments), Muon's too (Newton-Schulz of 0): what moves is decay."""
    lr, weight_decay = 0.01, 0.5
    model = llama(tied=False)
    params = list(model.parameters())
    optimizer = build_optimizer(OptimizerConfig(type=kind), model, params, lr=lr, weight_decay=weight_decay, no_decay=ALL)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    after = dict(model.named_parameters())
    for name in NORMS | BIASES | {"model.embed_tokens.weight"}:
        assert torch.equal(after[name], before[name]), name
    for name in [*sorted(MATRICES), "lm_head.weight"]:
        torch.testing.assert_close(after[name], before[name] * (1 - lr * weight_decay), rtol=1e-6, atol=0)
        assert after[name].norm() < before[name].norm()


def test_without_no_decay_a_zero_gradient_step_decays_the_norms_too():
    lr, weight_decay = 0.01, 0.5
    model = llama()
    optimizer = build_optimizer(OptimizerConfig(), model, list(model.parameters()), lr=lr, weight_decay=weight_decay)
    norm = model.model.norm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # Llama's norms start at 1
    norm.grad = torch.zeros_like(norm)
    optimizer.step()
    assert torch.allclose(norm, torch.full_like(norm, 1 - lr * weight_decay), rtol=0, atol=1e-7)
    assert math.isclose(float(norm.detach()[0]), 0.995, abs_tol=1e-7)
