"""`asyncrl bench engine`: what the engine side measures, its prompts, its FLOPs per token and the matmul limit.

What is measured (`bench.model`, default auto):
- no `policy.path`: the tiny policy (`policy.tiny`, random weights, built without an EOS token), prompts of
  `bench.prompt_tokens` random token ids.
- `policy.path` a checkpoint with an MTP layer (an SFT checkpoint of the tiny policy, as `asyncrl sft` writes
  it): the tiny policy as above, and the MTP drafting and FP8 part on the checkpoint (`engine_mtp.py`).
- any other transformers causal-LM directory (`policy.path`, e.g. `asyncrl model fetch smollm2-135m`): that
  checkpoint, "a real checkpoint", loaded by transformers in the dtype under test with its tokenizer; the
  prompts are the same fixed chat questions (`QUESTIONS`) rendered by its chat template. Its EOS is cleared
  from the model's config before the engine is built from it (the engine stops on the config's EOS), so every
  request makes exactly the new tokens asked for, as the tiny policy built without EOS does.
`bench.model=tiny` or `bench.model=checkpoint` overrides the choice.

FLOPs per decoded token: 2 x (every parameter but the input embedding, routed experts at top-k / experts, plus
the LM head; tied embeddings: the embedding matrix counted once, as the head). Attention over the context
(2 x 2 x layers x context x heads x head_dim) is not counted: at the bench's ~100-position contexts it is a
few percent of the total.

The matmul limit: `F.linear` FLOP/s of a decode-shaped product ([batch x hidden] times the model's
[intermediate x hidden] weight) and of a square one (`bench.matmul_size`), in the same process, on the same
threads, dtype and device as the engine; the better one of each measurement is the limit.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.configs import ConfigError
from asyncrl.configs.schema import RunConfig

QUESTIONS = (
    "What is the capital of France, and how did it become the capital?",
    "Explain in two sentences how a refrigerator keeps food cold.",
    "Write a haiku about the first snow of winter.",
    "List three uses of a paperclip that have nothing to do with paper.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "How many legs do three spiders and two cats have in total?",
    "Give me a short recipe for a tomato salad.",
    "What is the difference between weather and climate?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Suggest a name for a small bakery by the sea, and say why.",
    "Describe the water cycle in a few sentences.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain what a prime number is, with two examples.",
    "Write the opening line of a mystery novel set on a night train.",
    "Why do cats purr? Give the leading explanations.",
)
"""The chat prompts of a real checkpoint: question i % 16, numbered i + 1, so each of a batch's prompts differs."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Subject:
    """The model the engine side measures and how its prompts are made."""

    model: Any
    kind: str
    """"tiny" or "checkpoint"."""
    tokenizer: Any
    """The checkpoint's (chat prompts), or None (the tiny policy: random token ids)."""
    prompt_tokens: int
    seed: int

    def prompts(self, count: int, salt: int = 0) -> list[list[int]]:
        """`count` prompts: salt 0 the decode set (the tiny policy's: today's, `random.Random(seed)`), another salt
        different prompts, so no measurement reuses KV an earlier one computed."""
        if self.tokenizer is None:
            rng = random.Random(self.seed if salt == 0 else f"{self.seed}-{salt}")
            # Ids 16.. are ordinary characters in the embedded tokenizer; any in-vocabulary ids would do.
            return [[rng.randrange(16, self.model.config.vocab_size) for _ in range(self.prompt_tokens)] for _ in range(count)]
        rendered = []
        for i in range(count):
            number = f"{salt}-{i + 1}" if salt else f"{i + 1}"
            messages = [{"role": "user", "content": f"Question {number}: {QUESTIONS[i % len(QUESTIONS)]}"}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            rendered.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return rendered


def choose(config: RunConfig, model: str) -> tuple[str, bool]:
    """(what the engine side measures, "tiny" or "checkpoint"; whether the MTP/FP8 part runs on policy.path)."""
    from asyncrl.policy.checkpoint import has_mtp_layer

    path = config.policy.path
    if path is None:
        if model == "checkpoint":
            raise ConfigError("bench.model=checkpoint needs policy.path (a checkpoint directory)")
        return "tiny", False
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"policy.path={path}: no config.json there (not a Hugging Face model directory)")
    mtp = has_mtp_layer(path, json.loads(config_file.read_text()).get("model_type", ""))
    if model == "auto":
        return ("tiny" if mtp else "checkpoint"), mtp
    return model, mtp


def dtype_under_test(name: str) -> torch.dtype:
    """`bench.dtype`; bfloat16 only where the CPU has bfloat16 instructions or there is a GPU."""
    from asyncrl.policy.hardware import cpu_has_bf16

    if name == "bfloat16" and not (torch.cuda.is_available() or cpu_has_bf16()):
        raise ConfigError(
            "bench.dtype=bfloat16: this CPU lists no bfloat16 instructions (avx512_bf16, amx_bf16, bf16) and there is no "
            "GPU; torch would emulate bf16 matmuls, several times slower than float32. Bench float32 here."
        )
    return DTYPES[name]


def load_subject(config: RunConfig, kind: str, dtype: torch.dtype, prompt_tokens: int) -> Subject:
    """The measured model in `dtype`, without EOS (neither the engine nor generate() can stop early)."""
    if kind == "tiny":
        from transformers import AutoModelForCausalLM

        from asyncrl.policy.tiny import tiny_model_config

        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(tiny_model_config(config.policy.tiny, eos_token_id=None), dtype=dtype)
        return Subject(model.eval(), kind, None, prompt_tokens, config.seed)
    from asyncrl.policy.checkpoint import load_policy

    assert config.policy.path is not None
    name = next(key for key, value in DTYPES.items() if value == dtype)
    model, tokenizer, _ = load_policy(config.policy.path, name, config.policy.chat_template)
    if not tokenizer.chat_template:
        raise ConfigError(f"policy.path={config.policy.path}: its tokenizer has no chat template (set policy.chat_template)")
    model.config.eos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return Subject(model.eval(), kind, tokenizer, prompt_tokens, config.seed)


def flops_per_token(model) -> int:
    """2 x the parameters a decoded token runs through (the module docstring says which)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    config = model.config
    keys = ("n_routed_experts", "num_experts", "num_local_experts")
    experts = next((getattr(config, key) for key in keys if getattr(config, key, None)), None)
    active = getattr(config, "num_experts_per_tok", None)
    params = 0
    for name, parameter in model.named_parameters():
        if parameter is embedding:
            continue
        count = parameter.numel()
        if experts and active and ".experts." in f"{name}.":
            count = count * active // experts
        params += count
    if head is not None and head.weight is embedding:  # tied: named_parameters holds it once, as the embedding
        params += embedding.numel()
    return 2 * params


def matmul_gflop_s(model, batch: int, square: int, dtype: torch.dtype, device: torch.device, seconds: float = 0.3) -> dict[str, float]:
    """GFLOP/s of a decode-shaped and a square `F.linear` on `device`, the best of three timings each."""
    hidden = model.get_input_embeddings().weight.shape[1]
    intermediate = getattr(model.config, "intermediate_size", None) or 4 * hidden
    shapes = {"decode": (batch, hidden, intermediate), "square": (square, square, square)}
    return {name: round(_gflop_s(*shape, dtype=dtype, device=device, seconds=seconds), 2) for name, shape in shapes.items()}


def _gflop_s(m: int, k: int, n: int, *, dtype: torch.dtype, device: torch.device, seconds: float) -> float:
    x, weight = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    best = 0.0
    with torch.inference_mode():
        torch.nn.functional.linear(x, weight)  # warm-up
        for _ in range(3):
            sync()
            calls, start = 0, time.perf_counter()
            while calls == 0 or time.perf_counter() - start < seconds / 3:
                torch.nn.functional.linear(x, weight)
                calls += 1
            sync()
            best = max(best, 2 * m * k * n * calls / (time.perf_counter() - start) / 1e9)
    return best
