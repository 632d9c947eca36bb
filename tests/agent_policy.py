"""The policy real agent harnesses run against in tests and docs/AGENTS.md: a tiny dense model behind a
byte-level BPE tokenizer with a ChatML (Qwen2.5/Qwen3-style) chat template that renders tools.

Claude Code sends ~76k characters of prompt (24 tool definitions, 64k characters of JSON schema and
prose, plus a system prompt). The embedded character-level tokenizer would make that 76k tokens; this
BPE, trained here with `tokenizers` on the project's own Markdown, Python and JSON schemas (English
technical prose and JSON, like a harness's prompt), makes it 21.8k tokens, and the model's 32k context
holds it with room to answer. Nothing is downloaded; the same files give the same tokenizer.

    python tests/agent_policy.py DIR     # writes a Hugging Face directory `asyncrl serve policy.path=DIR` loads
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from asyncrl.configs.schema import EmbeddedRolloutConfig, GatewayConfig, SamplingConfig, TinyModelConfig
from asyncrl.gateway.engines import LocalEngine
from asyncrl.gateway.pool import EnginePool
from asyncrl.gateway.service import GatewayService
from asyncrl.gateway.store import open_store
from asyncrl.policy.checkpoint import save_policy
from asyncrl.policy.tiny import tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
GENERATION_PROMPT = IM_START + "assistant\n"
# Qwen's markup is added but not special: the template writes it, and the hermes parser reads it back.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
VOCAB_SIZE = 16384
"""The corpus gives ~17.6k merges at most; 16k already gets 3.5 characters a token on Claude Code's prompt."""
TOOL_PARSER = "hermes"
"""The gateway's `tool_parser` for this template (JSON calls in <tool_call> tags)."""
MAX_TOKENS = 256
"""gateway.max_tokens: harnesses ask for far more (Claude Code: 64000 a call), which the gateway clamps."""
SERVE_OVERRIDES = [
    f"gateway.tool_parser={TOOL_PARSER}", f"gateway.max_tokens={MAX_TOKENS}", "rollout.max_num_seqs=2",
]  # fmt: skip
"""`asyncrl serve` overrides for this policy: its paged KV cache holds at most two requests of 32k positions."""

SHAPE = TinyModelConfig(arch="qwen3", hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128, max_position_embeddings=32768)
"""One layer and one head: the embedded engine's prefill holds a prompt-by-prompt attention matrix per head, so
Claude Code's full 22k-token prompt costs ~2 GB for each (6.7 GB peak RSS) and 15-35 s on one CPU thread."""
EOS_LOGIT = 7.5
"""Every token's embedding carries a constant feature the LM head reads as "end the turn": the turn ends with
EOS after ~12 tokens on average. Harnesses treat a reply cut at max_tokens as unfinished (Claude Code asks the
model to continue, three times, then exits 1), so a policy that never stopped could not complete a session."""
SUPPRESSED_LOGIT = 30.0
"""How far below the rest the other special tokens' logits sit: never sampled in a test's lifetime."""

# Qwen2.5's template with Qwen3's handling of string arguments: a system message anywhere but first
# (Claude Code sends one mid-conversation) is its own system turn, consecutive tool results share a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n" }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus() -> Iterator[str]:
    """The project's docs, source and configs, and the JSON schemas of its config sections."""
    skipped = {"runs", "node_modules", "build", "dist"}  # and hidden folders: .git, .venv, caches
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if d not in skipped and not d.startswith("."))
        for name in sorted(files):
            if name.endswith((".md", ".py", ".yaml", ".toml")):
                yield Path(folder, name).read_text(errors="replace")
    from asyncrl.configs.schema import RunConfig

    yield json.dumps(RunConfig.model_json_schema(), indent=None)
    yield json.dumps(RunConfig.model_json_schema(), indent=2)


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    core.train_from_iterator(corpus(), trainer=trainer)
    core.add_special_tokens(SPECIAL_TOKENS)
    core.add_tokens(MARKUP_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, bos_token=None, unk_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = SHAPE.max_position_embeddings
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, shape: TinyModelConfig = SHAPE, seed: int = 0):
    import torch

    config = tiny_model_config(shape, eos_token_id=None)
    # Set after construction: the config validates its token ids against the embedded tokenizer's vocabulary.
    config.vocab_size, config.eos_token_id, config.pad_token_id = len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed[:, 0] = 1.0
        # Not after the generation prompt: an empty reply is one harnesses re-ask ("no visible output").
        embed[tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)[-1], 0] = 0.0
        head[:, 0] = 0.0
        # After RMSNorm (unit RMS) the constant feature reads ~sqrt(hidden); the other logits stay near 0.
        head[tokenizer.eos_token_id, 0] = EOS_LOGIT / shape.hidden_size**0.5
        # Never the other special tokens mid-reply (sampled ~1e-4 a token otherwise): a harness shows the
        # reply without them, and the tests compare it with the recorded tokens decoded the same way.
        head[[tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START)], 0] = -SUPPRESSED_LOGIT / shape.hidden_size**0.5
    return model


def save_agent_policy(directory: str | Path, shape: TinyModelConfig = SHAPE) -> Path:
    """The policy as a Hugging Face directory (`load_policy` / `policy.path` read it)."""
    tokenizer = build_tokenizer()
    return save_policy(directory, build_model(tokenizer, shape), tokenizer)


@functools.cache
def agent_policy() -> tuple[PreTrainedTokenizerFast, PreTrainedModel]:
    """(tokenizer, model), built once per test process (training the tokenizer takes seconds); engines copy
    the weights, so tests may share them."""
    tokenizer = build_tokenizer()
    return tokenizer, build_model(tokenizer)


def agent_service(store_path: Path, **gateway: Any) -> tuple[GatewayService, Any]:
    """(gateway service, its one embedded engine) over `agent_policy()`, configured as SERVE_OVERRIDES serve it."""
    from asyncrl.rollout import EmbeddedEngine

    tokenizer, model = agent_policy()
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(device="cpu", torch_threads=1, max_num_seqs=2), engine_id="e0")
    config = GatewayConfig(**{"tool_parser": TOOL_PARSER, "max_tokens": MAX_TOKENS, "sampling_overrides": "allow", **gateway})
    pool = EnginePool(config)
    pool.add_local(LocalEngine(engine))
    return GatewayService(open_store(store_path), tokenizer, pool, config, SamplingConfig(max_tokens=32)), engine


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/agent_policy.py DIR")
    print(save_agent_policy(sys.argv[1]))
