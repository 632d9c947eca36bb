"""The embedded character-level tokenizer, its chat template and the tool-call markup.

Built with the `tokenizers` library and saved as a `PreTrainedTokenizerFast` directory, so
`AutoTokenizer.from_pretrained(path)` loads it offline. Every printable ASCII character and the
newline is one token; the chat roles and the tool-call markup (GLM-4.5/GLM-5 style XML tags) are
single special tokens, so rendering and parsing never depend on how text happens to split.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
EOS = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
OBSERVATION = "<|observation|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY_OPEN, ARG_KEY_CLOSE = "<arg_key>", "</arg_key>"
ARG_VALUE_OPEN, ARG_VALUE_CLOSE = "<arg_value>", "</arg_value>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

SPECIAL_TOKENS = [
    PAD, EOS, SYSTEM, USER, ASSISTANT, OBSERVATION,
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ARG_KEY_OPEN, ARG_KEY_CLOSE, ARG_VALUE_OPEN, ARG_VALUE_CLOSE,
    TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE, THINK_OPEN, THINK_CLOSE,
]  # fmt: skip
CHARACTERS = ["\n"] + [chr(code) for code in range(32, 127)]
VOCAB_SIZE = 128
"""Embedding rows of the tiny policy: the tokens above plus reserved ids, rounded up."""

# An assistant turn ends with EOS, which the model samples itself; a tool call is rendered exactly as
# the model is taught to write it, so a rendered conversation and a sampled one are the same tokens.
# Arguments may be a mapping of JSON values (non-strings written as JSON, as GLM-4.5's template does)
# or (OpenAI wire format) a JSON string, which is rendered verbatim.
CHAT_TEMPLATE = (
    "{%- if tools -%}" + SYSTEM + "tools:{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}"
    "{% endfor %}\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}" + SYSTEM + "{{ m.content }}"
    "{%- elif m.role == 'user' -%}" + USER + "{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}" + ASSISTANT + "{{ m.content or '' }}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    + TOOL_CALL_OPEN + "{{ f.name }}"
    "{%- if f.arguments is mapping -%}"
    "{%- for k, v in f.arguments.items() -%}"
    + ARG_KEY_OPEN + "{{ k }}" + ARG_KEY_CLOSE + ARG_VALUE_OPEN + "{{ v if v is string else v | tojson }}" + ARG_VALUE_CLOSE
    + "{%- endfor -%}"
    "{%- else -%}" + ARG_VALUE_OPEN + "{{ f.arguments }}" + ARG_VALUE_CLOSE + "{%- endif -%}"
    + TOOL_CALL_CLOSE +
    "{%- endfor -%}" + EOS +
    "{%- elif m.role == 'tool' -%}" + OBSERVATION + TOOL_RESPONSE_OPEN + "{{ m.content }}" + TOOL_RESPONSE_CLOSE +
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)  # fmt: skip


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded tokenizer: specials first (PAD=0, EOS=1), then characters, then reserved ids."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(vocab))]
    # BPE with no merges is a character-level model whose vocabulary we control exactly.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS + reserved)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=None, unk_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1 << 20
    return tokenizer


def save_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(path))
    return tokenizer
