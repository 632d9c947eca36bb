"""The learner's and SFT's optimizers (learner/optim.py): AdamW as before, Muon, and Muon Split.

Exact references use float64 SVD (the polar factor U V^T of each block). torch's Muon runs a
5-step quintic Newton-Schulz in bfloat16 that by design stops short of U V^T (its singular values
land around [0.68, 1.2] on these shapes), so the optimizer is compared bit for bit with that same
Newton-Schulz per head, and only loosely (stated below) with the exact SVD.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from asyncrl.configs.loader import ConfigError, validate
from asyncrl.configs.schema import LearnerConfig, OptimizerConfig, RunConfig, TinyModelConfig
from asyncrl.jobs.sft import demo_stream
from asyncrl.learner.optim import WHOLE, BlockMuon, CombinedOptimizer, Layout, blocks, build_optimizer, partition
from asyncrl.learner.rl import RLLearner
from asyncrl.learner.sft import sft_optimizer, train_step
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import build_mtp
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, due_after_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NS = torch.optim.Muon([torch.zeros(1, 1)]).defaults
"""torch's Newton-Schulz coefficients and eps."""


def polar(matrix: torch.Tensor) -> torch.Tensor:
    """U V^T of the SVD: the exact orthogonalization."""
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    return torch.optim._muon._zeropower_via_newtonschulz(matrix, NS["ns_coefficients"], steps, NS["eps"])


def split_polar(matrix: torch.Tensor, layout: Layout) -> torch.Tensor:
    out = matrix.clone()
    for block, target in zip(blocks(matrix, layout), blocks(out, layout), strict=True):
        target.copy_(polar(block))
    return out


@pytest.mark.parametrize("layout", [Layout("rows", 4), Layout("cols", 4)])
def test_per_head_orthogonalization_is_orthogonal_per_head_and_not_the_whole_matrix_one(layout):
    torch.manual_seed(0)
    grad = torch.randn(4 * 8, 32, dtype=torch.float64) if layout.split == "rows" else torch.randn(32, 4 * 8, dtype=torch.float64)
    per_head = split_polar(grad, layout)
    whole = polar(grad)
    eye = torch.eye(8, dtype=torch.float64)
    heads = blocks(per_head, layout)
    for head in heads:
        gram = head @ head.T if layout.split == "rows" else head.T @ head
        torch.testing.assert_close(gram, eye, rtol=0, atol=1e-5)
    # Heads are orthogonalized apart: their cross products are not zero, as they are in the whole matrix's.
    cross = heads[0] @ heads[1].T if layout.split == "rows" else heads[0].T @ heads[1]
    assert cross.abs().max() > 0.1
    assert (per_head - whole).norm() / whole.norm() > 0.3


def test_torchs_newton_schulz_per_head_is_near_the_exact_per_head_polar_factor():
    """The NS tolerance: singular values in [0.6, 1.25] and within 0.3 relative (Frobenius) of the exact
    per-head U V^T, and much nearer it than the whole matrix's orthogonalization is."""
    torch.manual_seed(1)
    grad = torch.randn(4 * 8, 32)
    layout = Layout("rows", 4)
    exact = split_polar(grad.double(), layout)
    whole = polar(grad.double())
    for block, reference, coupled in zip(blocks(grad, layout), blocks(exact, layout), blocks(whole, layout), strict=True):
        approx = newton_schulz(block).double()
        values = torch.linalg.svdvals(approx)
        assert values.min() >= 0.6 and values.max() <= 1.25
        assert (approx - reference).norm() / reference.norm() < 0.3
        assert (approx - reference).norm() < 0.6 * (approx - coupled).norm()


def reference_muon_step(param, grad, buffer, layout, *, lr, weight_decay, momentum, adjust):
    """One Muon step on `param`, each block of `layout` by hand: Nesterov momentum, the same NS, the block's scale."""
    buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(buffer, momentum)
    new = param * (1 - lr * weight_decay)
    for target, block in zip(blocks(new, layout), blocks(update, layout), strict=True):
        rows, cols = block.shape
        scale = 0.2 * max(rows, cols) ** 0.5 if adjust == "match_rms_adamw" else max(1.0, rows / cols) ** 0.5
        target.sub_(lr * scale * newton_schulz(block).float())
    return new


@pytest.mark.parametrize(
    ("suffix", "layout"),
    [
        ("layers.0.self_attn.q_b_proj.weight", Layout("rows", 2)),
        ("layers.0.self_attn.kv_b_proj.weight", Layout("rows", 2)),
        ("layers.0.self_attn.o_proj.weight", Layout("cols", 2)),
        ("layers.0.self_attn.indexer.wq_b.weight", Layout("rows", 2)),
        ("layers.0.mlp.gate_proj.weight", WHOLE),
        ("layers.1.mlp.experts.gate_up_proj", Layout("experts", 4)),
    ],
)
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_split_update_equals_the_per_head_reference_with_the_same_newton_schulz(suffix, layout, adjust):
    """Two steps (momentum included) on the tiny GLM-5 shape; equal to 1e-6 (float32, same bf16 NS)."""
    model = make_tiny_model("glm_moe_dsa")
    params = list(model.parameters())
    config = OptimizerConfig(type="muon_split", adjust_lr_fn=adjust, ns_dtype="bfloat16")
    optimizer = build_optimizer(config, model, params, lr=0.02, weight_decay=0.1)
    param = model.get_parameter(f"model.{suffix}")
    expected, buffer = param.detach().clone(), torch.zeros_like(param)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        expected = reference_muon_step(
            expected, param.grad, buffer, layout, lr=0.02, weight_decay=0.1, momentum=config.momentum, adjust=adjust
        )
        optimizer.step()
    torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)


def test_whole_matrices_get_torchs_muon_bit_for_bit():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(24, 40)), torch.nn.Parameter(torch.randn(24, 40))
    theirs.data.copy_(ours.data)
    options = dict(lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    block_muon, torch_muon = BlockMuon([(WHOLE, [ours])], **options), torch.optim.Muon([theirs], **options)
    for _ in range(3):
        grad = torch.randn(24, 40)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        block_muon.step()
        torch_muon.step()
    assert torch.equal(ours, theirs)
    assert torch.equal(block_muon.state[ours]["momentum_buffer"], torch_muon.state[theirs]["momentum_buffer"])


def test_float32_newton_schulz_is_torchs_iteration_at_float32_and_the_cpu_default():
    """ns_dtype float32: the same update as torch's but for the precision of the iterations: equal to the update
    computed in float64 within float32's error, and to torch's bfloat16 one within bfloat16's."""
    torch.manual_seed(0)
    options = dict(lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    start = torch.randn(24, 40)
    runs = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        param = torch.nn.Parameter(start.clone().to(torch.float64 if dtype == torch.float64 else torch.float32))
        optimizer = BlockMuon([(WHOLE, [param])], **options, ns_dtype=dtype)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            param.grad = torch.randn(24, 40, generator=generator).to(param.dtype)
            optimizer.step()
        runs[dtype] = param.detach().double() - start.double()
    torch.testing.assert_close(runs[torch.float32], runs[torch.float64], rtol=0, atol=1e-6)
    assert (runs[torch.bfloat16] - runs[torch.float64]).abs().max() < 0.02 * runs[torch.float64].abs().max()
    model = make_tiny_model("glm_moe_dsa")
    on_cpu = build_optimizer(OptimizerConfig(type="muon"), model, list(model.parameters()), lr=0.01, weight_decay=0.0)
    assert on_cpu.optimizers["muon"].ns_dtype == torch.float32


def test_the_parameter_split_of_the_tiny_qwen3_shape_with_grouped_query_heads():
    model = make_tiny_model("qwen3", num_heads=4, config_overrides={"num_key_value_heads": 2, "head_dim": 8})
    mtp = build_mtp(model, seed=1)
    placed = partition(model, [*model.parameters(), *mtp.parameters()], split_heads=True, extra=[mtp]).names()
    layer = {k.removeprefix("model.layers.0."): v for k, v in placed.items() if k.startswith("model.layers.0.")}
    assert layer == {
        "self_attn.q_proj.weight": "muon/rows:4", "self_attn.k_proj.weight": "muon/rows:2", "self_attn.v_proj.weight": "muon/rows:2",
        "self_attn.o_proj.weight": "muon/cols:4", "self_attn.q_norm.weight": "adamw", "self_attn.k_norm.weight": "adamw",
        "mlp.gate_proj.weight": "muon", "mlp.up_proj.weight": "muon", "mlp.down_proj.weight": "muon",
        "input_layernorm.weight": "adamw", "post_attention_layernorm.weight": "adamw",
    }  # fmt: skip
    assert placed["model.embed_tokens.weight"] == placed["lm_head.weight"] == placed["model.norm.weight"] == "adamw"
    assert placed["mtp.eh_proj.weight"] == "muon" and placed["mtp.block.self_attn.o_proj.weight"] == "muon/cols:4"
    assert placed["mtp.enorm.weight"] == "adamw"
    # The MTP layer shares the policy's embedding and head: each parameter is placed once.
    assert len(placed) == len({id(p) for p in [*model.parameters(), *mtp.parameters()]})
    unsplit = partition(model, list(model.parameters()), split_heads=False).names()
    assert unsplit["model.layers.0.self_attn.q_proj.weight"] == "muon"


def test_the_parameter_split_of_the_tiny_glm5_shape():
    model = make_tiny_model("glm_moe_dsa")
    placed = partition(model, list(model.parameters()), split_heads=True).names()
    attention = {k.removeprefix("model.layers.1.self_attn."): v for k, v in placed.items() if ".layers.1.self_attn." in k}
    assert attention == {
        "q_a_proj.weight": "muon", "q_a_layernorm.weight": "adamw", "q_b_proj.weight": "muon/rows:2",
        "kv_a_proj_with_mqa.weight": "muon", "kv_a_layernorm.weight": "adamw", "kv_b_proj.weight": "muon/rows:2",
        "o_proj.weight": "muon/cols:2", "indexer.wq_b.weight": "muon/rows:2", "indexer.wk.weight": "muon",
        "indexer.k_norm.weight": "adamw", "indexer.k_norm.bias": "adamw", "indexer.weights_proj.weight": "adamw",
    }  # fmt: skip
    mlp = {k.removeprefix("model.layers.1.mlp."): v for k, v in placed.items() if ".layers.1.mlp." in k}
    assert mlp == {
        "experts.gate_up_proj": "muon/experts", "experts.down_proj": "muon/experts", "gate.weight": "adamw",
        "shared_experts.gate_proj.weight": "muon", "shared_experts.up_proj.weight": "muon", "shared_experts.down_proj.weight": "muon",
    }  # fmt: skip
    # A head layout that does not match the weights (here: the config claims 3 heads) is refused by name.
    model.config.num_attention_heads = 3
    with pytest.raises(ValueError, match="q_b_proj"):
        partition(model, list(model.parameters()), split_heads=True)


def test_adamw_stays_the_default_and_is_plain_torch_adamw():
    assert LearnerConfig().optimizer.type == RunConfig().sft.optimizer.type == "adamw"
    model = make_tiny_model("qwen3")
    optimizer = build_optimizer(OptimizerConfig(), model, list(model.parameters()), lr=1e-3, weight_decay=0.01)
    assert type(optimizer) is torch.optim.AdamW
    reference = torch.optim.AdamW(list(model.parameters()), lr=1e-3, weight_decay=0.01)
    assert optimizer.defaults == reference.defaults and len(optimizer.param_groups) == 1
    learner = RLLearner(LearnerConfig(group_size=2, lr=3e-4, weight_decay=0.05), model, build_tokenizer())
    assert type(learner.optimizer) is torch.optim.AdamW
    assert learner.optimizer.defaults == torch.optim.AdamW(learner.params, lr=3e-4, weight_decay=0.05).defaults


@pytest.mark.parametrize("section", ["learner", "sft"])
def test_a_bad_optimizer_type_names_the_key(section):
    with pytest.raises(ConfigError, match=rf"{section}\.optimizer\.type: Input should be 'adamw', 'muon' or 'muon_split'"):
        validate({section: {"optimizer": {"type": "adam"}}})


PROMPT = [3, 4, 5]


def rl_batch(learner: RLLearner) -> Batch:
    """One GRPO group of two rollouts with different rewards, log-probs the policy's own."""
    out = []
    for rollout, reward, completion in (("a", 1.0, [10, 11, 12]), ("b", 0.0, [20, 21])):
        ids = PROMPT + completion
        mask = [0] * len(PROMPT) + [1] * len(completion)
        with torch.no_grad():
            logits = learner.model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        logprobs = [0.0, *logits.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()]
        versions = [0 if m else UNSAMPLED_VERSION for m in mask]
        out.append(Sample(ids, mask, [lp * m for lp, m in zip(logprobs, mask, strict=True)], versions, reward, "g", rollout, "ok"))
    return Batch([out])


def muon_split_learner(arch: str = "qwen3", **config) -> RLLearner:
    model = make_tiny_model(arch)
    options = {"group_size": 2, "lr": 1e-3, "optimizer": {"type": "muon_split"}, "mtp_loss_weight": 0.3, **config}
    return RLLearner(LearnerConfig(**options), model, build_tokenizer(), build_mtp(model, seed=1))


def test_an_rl_step_with_muon_split_trains_the_glm5_shape_and_keeps_the_indexer_frozen():
    learner = muon_split_learner("glm_moe_dsa")
    assert isinstance(learner.optimizer, CombinedOptimizer)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    step = learner.train_step(rl_batch(learner))
    assert step.stepped and step.metrics["mtp_loss"] > 0
    moved = {name for name, p in learner.model.named_parameters() if not torch.equal(p, before[name])}
    assert {"model.layers.0.self_attn.q_b_proj.weight", "model.layers.1.mlp.experts.gate_up_proj", "lm_head.weight"} <= moved
    assert not {name for name in moved if ".indexer." in name}


def test_muon_split_state_resumes_identically_and_a_push_reset_clears_it(tmp_path):
    learner = muon_split_learner()
    batch = rl_batch(learner)
    learner.train_step(batch)
    learner.save(tmp_path / "ckpt")
    resumed, forgetful = muon_split_learner(), muon_split_learner()
    resumed.load(tmp_path / "ckpt")
    forgetful.load(tmp_path / "ckpt")
    forgetful.reset_optimizer()  # the weights without the momentum: must not be the same run
    assert len(resumed.optimizer.state) == len(learner.optimizer.state) > 0
    inner_groups = [g for o in resumed.optimizer.optimizers.values() for g in o.param_groups]
    assert all(a is b for a, b in zip(resumed.optimizer.param_groups, inner_groups, strict=True))
    for _ in range(2):
        for run in (learner, resumed, forgetful):
            run.train_step(batch)
    assert all(torch.equal(p, q) for p, q in zip(learner.params, resumed.params, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(learner.params, forgetful.params, strict=True))

    resetting = muon_split_learner(reset_optimizer_on_push=True)
    step = resetting.train_step(batch)
    config = resetting.config
    assert due_after_step(0, step.version, push_every=config.push_every, checkpoint_every=config.checkpoint_every).push
    assert len(resetting.optimizer.state) == 0
    assert not any(o.state for o in resetting.optimizer.optimizers.values())


def test_an_sft_run_of_steps_with_muon_split_lowers_the_loss_under_the_warmup_schedule():
    shape = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)
    config = RunConfig(policy={"tiny": TinyModelConfig(arch="glm_moe_dsa", **shape)}, sft={"optimizer": {"type": "muon_split"}})
    tok = build_tokenizer()
    demos = demo_stream(config, tok, seed=1).batch(8)
    model, _, mtp = build_policy(config.policy, seed=0)
    params = [p for m in (model, mtp) for p in m.parameters() if p.requires_grad]
    optimizer = sft_optimizer(config.sft, model, mtp, params)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    losses = []
    for _ in range(6):
        loss, aux, _ = train_step(config, model, mtp, demos, tok.pad_token_id)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss)
    assert aux is not None and losses[-1] < losses[0]
    # The schedule reaches both inner optimizers' groups.
    assert {g["lr"] for g in optimizer.param_groups} == {config.sft.lr}


SHARDED_SHAPES = [(WHOLE, (24, 40)), (WHOLE, (40, 24)), (Layout("rows", 2), (32, 16)), (WHOLE, (16, 16)), (Layout("cols", 2), (8, 32))]
"""Five Muon matrices of two layouts and uneven sizes: three rounds of two ranks, the last one short."""


def _muon_matrices() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for _, shape in SHARDED_SHAPES]


def _muon_steps(optimizer: torch.optim.Optimizer, params: list, shard) -> None:
    generator = torch.Generator().manual_seed(6)
    for _ in range(2):
        for param in params:
            param.grad = shard(torch.randn(param.shape, generator=generator))
        optimizer.step()


def _sharded_muon_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks: the matrices sharded on dim 0 as FSDP shards them, two BlockMuon steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in _muon_matrices()]
    groups = [(layout, [param]) for (layout, _), param in zip(SHARDED_SHAPES, params, strict=True)]
    optimizer = BlockMuon(groups, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    calls = []
    orthogonalized = optimizer._orthogonalized
    optimizer._orthogonalized = lambda update, group: (calls.append(tuple(update.shape)), orthogonalized(update, group))[1]
    _muon_steps(optimizer, params, lambda whole: distribute_tensor(whole, mesh, [Shard(0)]))
    torch.save({"params": [p.full_tensor() for p in params], "calls": calls}, f"{out_dir}/rank{rank}.pt")
    # Both ranks past their last collective before either tears gloo down: a rank that exits while its peer's
    # pair threads still talk to it was seen to abort the peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_matrices_take_the_whole_update_and_each_newton_schulz_runs_on_one_rank(tmp_path):
    params = _muon_matrices()
    alone = BlockMuon([(layout, [p]) for (layout, _), p in zip(SHARDED_SHAPES, params, strict=True)], lr=0.02, weight_decay=0.1,
                      adjust_lr_fn="match_rms_adamw")  # fmt: skip
    _muon_steps(alone, params, lambda whole: whole)
    torch.multiprocessing.spawn(_sharded_muon_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        for sharded, whole in zip(rank["params"], params, strict=True):
            torch.testing.assert_close(sharded, whole.detach(), rtol=0, atol=1e-6)
    blocks_per_step = sum(layout.parts if layout.split in ("rows", "cols") else 1 for layout, _ in SHARDED_SHAPES)
    # Matrices 0, 2, 4 are rank 0's (rounds of two), 1 and 3 rank 1's; two steps each.
    assert len(ranks[0]["calls"]) + len(ranks[1]["calls"]) == 2 * blocks_per_step
    assert sorted(set(ranks[1]["calls"])) == [(16, 16), (40, 24)] and (24, 40) in ranks[0]["calls"]
