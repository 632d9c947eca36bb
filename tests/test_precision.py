"""`learner.precision` (fp32 | bf16-mixed) on a tiny random Llama checkpoint: float32 master weights and optimizer
state in both modes whatever `policy.dtype` is, one bf16-mixed step agreeing with the fp32 one to bfloat16's
precision, the embedded engine's log-probs agreeing with the learner's in each dtype (and after a push of float32
weights into a bfloat16 engine), checkpoints in float32, and the refusals and the warning that name the setting.

Measured on the 2-core CPU machine (AMX bf16), seed 0: see each tolerance's docstring.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import run_to_completion, unit_scale_
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.configs.loader import ConfigError, load_config
from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.learner import sharding
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.hardware import cpu_has_bf16
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, SamplingParams
from asyncrl.rollout import EmbeddedEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # fp32 forwards compared to 1e-4, on one thread

LOSS_ATOL = 2e-2
"""bf16-mixed vs fp32 step loss, absolute (seen: 5e-3). The loss is a token mean of advantage (|A| < 1 here) x
ratio, the advantages of both signs cancelling, so bfloat16's ~1e-2 error in a log-prob moves it by about that
much, however small the loss; a relative bound would depend on the cancellation."""
UPDATE_RTOL = 2e-2
"""bf16-mixed vs fp32: the gradient norm (seen: 4e-3) and the weight update's norm, relative."""
UPDATE_COSINE = 0.95
"""bf16-mixed vs fp32: cosine of the two weight updates, least (seen: 0.991). AdamW's first update is about
lr x sign(gradient), so it is the direction, not the norm, that bfloat16's rounding can move."""
LOGP_GAP = (1e-4, 5e-2)
"""bf16-mixed vs fp32 learner log-probs on the same weights: the mean |diff| above the first (autocast ran;
seen: 6e-3), the largest below the second (seen: 3e-2, of log-probs around -5)."""
MTP_RTOL = 1e-3
"""bf16-mixed vs fp32 MTP loss, relative (seen: 1e-4): the MTP layer computes in float32 in both modes."""
FP32_GAP = 1e-4
"""Engine (float32) vs learner (fp32) log-prob of each sampled token, largest (seen: 2e-6)."""
BF16_GAP = 5e-2
"""Engine (bfloat16) vs learner (bf16-mixed) log-prob of a sampled token, mean over the sampled tokens (seen:
7e-3 to 1e-2, largest 3e-2; a bfloat16 engine vs an fp32 learner: the same, 8e-3)."""
PROMPTS = [[5, 17, 33, 9], [40, 41, 42], [20, 21, 22, 23, 24], [60, 7]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama (unit-scale weights, so bfloat16's rounding shows in the numbers) saved in float32."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = unit_scale_(LlamaForCausalLM(config).eval())
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def run(llama, precision: str, dtype: str, *overrides: str):
    return load_config(
        "quickstart",
        [
            f"policy.path={llama}", f"policy.dtype={dtype}", "policy.mtp.enabled=false", f"learner.precision={precision}",
            "learner.device=cpu", "learner.group_size=2", "learner.lr=1e-3", "learner.weight_decay=0.0", *overrides,
        ],
    )  # fmt: skip


def learner_for(llama, precision: str, dtype: str, *overrides: str) -> RLLearner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16-mixed on a CPU without bfloat16 instructions says so
        return RLLearner.from_config(run(llama, precision, dtype, *overrides))


def own_logprobs(learner: RLLearner, token_ids: list[int]) -> list[float]:
    """The learner's float32 log-prob of every token given the ones before it (0.0 for token 0)."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        return [0.0, *sampled_logprobs(learner.model(input_ids=ids).logits, ids, 1.0)[0].tolist()]


def hand_built(learner: RLLearner) -> list[list[Sample]]:
    """Two groups of two, completions of unequal lengths (the token-mean loss does not cancel) after a prompt long
    enough to be scored once per group (learner/prefix.py), rollout log-probs the fp32 policy's own shifted per
    token, so the ratios spread inside the band."""
    completions = [([10, 11, 12, 13, 14, 15], 1.0), ([20, 21], 0.0), ([30, 31, 32], 0.0), ([40, 41, 42, 43, 44], 1.0)]
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i, (completion, reward) in enumerate(completions):
        prompt = [3 + j + 40 * (i // 2) for j in range(12)]
        mask = [0] * len(prompt) + [1] * len(completion)
        shift = (torch.rand(len(mask), generator=generator) - 0.5) * 0.2
        logprobs = [lp + float(d) if m else 0.0 for lp, d, m in zip(own_logprobs(learner, prompt + completion), shift, mask, strict=True)]
        versions = [0 if m else UNSAMPLED_VERSION for m in mask]
        samples.append(Sample(prompt + completion, mask, logprobs, versions, reward, f"g{i // 2}", f"r{i}", "ok"))
    return [samples[:2], samples[2:]]


def assert_float32_master(learner: RLLearner) -> None:
    params = [*learner.model.parameters(), *(learner.mtp.parameters() if learner.mtp is not None else [])]
    assert {p.dtype for p in params} == {torch.float32}
    state = [t for s in learner.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert state and {t.dtype for t in state} == {torch.float32}


def weights(learner: RLLearner) -> dict[str, torch.Tensor]:
    return {**learner.model.state_dict(), **{f"mtp.{n}": t for n, t in learner.mtp.state_dict().items()}}


def test_bf16_mixed_and_fp32_agree_on_a_step_with_float32_master_weights(llama, tmp_path):
    # policy.dtype bfloat16 (the engines'): both learners cast their copy to float32 after loading.
    mtp = ("policy.mtp.enabled=true", "learner.mtp_loss_weight=0.3")
    fp32, mixed = learner_for(llama, "fp32", "bfloat16", *mtp), learner_for(llama, "bf16-mixed", "bfloat16", *mtp)
    assert fp32.scorer.autocast is None and mixed.scorer.autocast is torch.bfloat16
    before = {name: t.clone() for name, t in weights(fp32).items()}
    assert all(torch.equal(before[name], t) for name, t in weights(mixed).items())
    ids = torch.randint(2, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    with torch.no_grad():
        gap = (fp32.scorer(ids, ones, ones, ones, ones * 0.0)[0] - mixed.scorer(ids, ones, ones, ones, ones * 0.0)[0]).abs()
    groups = hand_built(fp32)
    steps = [learner.train_step(Batch(groups)) for learner in (fp32, mixed)]
    for learner, step in zip((fp32, mixed), steps, strict=True):
        assert step.stepped and step.metrics["prefix_skipped_tokens"] > 0  # the shared-prefix forward ran too
        assert_float32_master(learner)
    delta = [torch.cat([(t - before[n]).flatten() for n, t in weights(learner).items()]) for learner in (fp32, mixed)]
    loss_gap = abs(steps[1].loss - steps[0].loss)
    grad_gap = abs(steps[1].grad_norm - steps[0].grad_norm) / steps[0].grad_norm
    update_gap = abs(float(delta[1].norm() - delta[0].norm())) / float(delta[0].norm())
    cosine = float(torch.nn.functional.cosine_similarity(delta[0], delta[1], dim=0))
    mtp_gap = abs(steps[1].metrics["mtp_loss"] - steps[0].metrics["mtp_loss"]) / steps[0].metrics["mtp_loss"]
    assert LOGP_GAP[0] < float(gap.mean()) and float(gap.max()) < LOGP_GAP[1]
    assert loss_gap < LOSS_ATOL and grad_gap < UPDATE_RTOL and update_gap < UPDATE_RTOL and cosine > UPDATE_COSINE
    assert mtp_gap < MTP_RTOL
    # The checkpoint holds the float32 master weights: a resume is exact.
    saved = mixed.save(tmp_path / "ckpt")
    assert json.loads((saved / "config.json").read_text())["dtype"] == "float32"
    resumed = learner_for(llama, "bf16-mixed", "bfloat16", *mtp)
    resumed.load(saved)
    assert all(torch.equal(weights(resumed)[n], t) for n, t in weights(mixed).items())
    assert_float32_master(resumed)


def engine_samples(engine: EmbeddedEngine, seed: int) -> list[list[Sample]]:
    """Two completions of each prompt (one group each), rewards 1 and 0 so that every row is scored."""
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed + i) for i in range(2 * len(PROMPTS))]
    results = run_to_completion(engine, [(PROMPTS[i // 2], p) for i, p in enumerate(params)])
    groups = []
    for g in range(len(PROMPTS)):
        group = []
        for i in (2 * g, 2 * g + 1):
            r = results[i]
            n, m = len(r.prompt_token_ids), len(r.token_ids)
            group.append(Sample(
                r.prompt_token_ids + r.token_ids, [0] * n + [1] * m, [0.0] * n + list(r.logprobs),
                [UNSAMPLED_VERSION] * n + [engine.version] * m, float(i % 2), f"g{g}", f"r{i}", "ok",
            ))  # fmt: skip
        groups.append(group)
    return groups


@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("bf16-mixed", "bfloat16")])
def test_engine_and_learner_log_probs_agree_in_each_dtype_and_after_a_push(llama, precision, dtype):
    config = run(llama, precision, dtype)
    model, _, _ = build_policy(config.policy, config.seed)
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=8, device="cpu"))
    try:
        assert engine.dtype == getattr(torch, dtype)
        learner = learner_for(llama, precision, dtype)
        step = learner.train_step(Batch(engine_samples(engine, seed=0)))
        # A push of the float32 master weights into the engine, which casts them to its dtype as it loads.
        engine.load_weights(learner.state_dict_for_push(), learner.version)
        loaded = engine.model.weights
        tensors = [t for part in (loaded, *loaded["layers"]) for t in part.values() if isinstance(t, torch.Tensor)]
        assert {t.dtype for t in tensors} == {engine.dtype}
        assert torch.equal(loaded["lm_head"], learner.model.lm_head.weight.detach().to(engine.dtype))
        after = learner.train_step(Batch(engine_samples(engine, seed=100)))
    finally:
        engine.shutdown()
    for s in (step, after):
        assert s.stepped and s.metrics["computed_trainable_tokens"] > 0
        if precision == "fp32":
            assert s.metrics["logprob_gap_max"] < FP32_GAP
        else:
            assert s.metrics["abs_logp_diff"] < BF16_GAP


def test_an_invalid_precision_names_learner_precision():
    with pytest.raises(ConfigError, match=r"learner\.precision"):
        load_config("quickstart", ["learner.precision=fp16"])
    with pytest.raises(ValueError, match=r"learner\.precision"):
        sharding.autocast_dtype("fp16", torch.device("cpu"))


def test_bf16_mixed_is_refused_on_a_gpu_without_bfloat16_and_warned_about_on_a_cpu_without(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(ValueError, match=r"learner\.precision=bf16-mixed: Tesla V100 has no bfloat16 units"):
        sharding.autocast_dtype("bf16-mixed", torch.device("cuda"))
    assert sharding.autocast_dtype("fp32", torch.device("cuda")) is None
    monkeypatch.setattr(sharding, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match=r"learner\.precision=bf16-mixed: .* emulated"):
        assert sharding.autocast_dtype("bf16-mixed", torch.device("cpu")) is torch.bfloat16
    monkeypatch.setattr(sharding, "cpu_has_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sharding.autocast_dtype("bf16-mixed", torch.device("cpu")) is torch.bfloat16


def test_cpu_bf16_detection_reads_the_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cases = [
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n", False),
        ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n", True),
        ("flags\t\t: fpu amx_bf16 amx_tile\n", True),
        ("Features\t: fp asimd bf16 i8mm\n", True),
        ("model name\t: bf16 in a name is no flag\nflags\t: fpu\n", False),
    ]
    for text, expected in cases:
        cpuinfo.write_text(text)
        assert cpu_has_bf16(cpuinfo) is expected
    assert cpu_has_bf16(tmp_path / "missing") is False
