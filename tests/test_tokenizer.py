"""The char-level tokenizer: round trips, offline loading, and the exact chat/tool-call rendering."""

from __future__ import annotations

from transformers import AutoTokenizer

from asyncrl.envs.tool_demos import PYTHON_TOOL, ToolProblem
from asyncrl.policy.tokenizer import CHARACTERS, EOS, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer, save_tokenizer


def test_round_trip_and_one_token_per_character():
    tok = build_tokenizer()
    text = "".join(CHARACTERS) + "".join(SPECIAL_TOKENS) + "12+34=46\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == len(CHARACTERS) + len(SPECIAL_TOKENS) + 9
    assert max(ids) < VOCAB_SIZE
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1 and tok.convert_ids_to_tokens(1) == EOS


def test_auto_tokenizer_loads_the_saved_directory_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    original = save_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<|user|>What is 5 minus 3?<|assistant|>2<|endoftext|>"
    assert loaded.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    messages = ToolProblem(12, 345).demonstration()
    assert loaded.apply_chat_template(messages, tools=[PYTHON_TOOL], tokenize=False) == original.apply_chat_template(
        messages, tools=[PYTHON_TOOL], tokenize=False
    )


def test_chat_template_renders_tool_calls_exactly_as_taught():
    tok = build_tokenizer()
    rendered = tok.apply_chat_template(ToolProblem(123, 456).demonstration(), tools=[PYTHON_TOOL], tokenize=False)
    assert rendered == (
        "<|system|>tools: python"
        "<|user|>123*456"
        "<|assistant|><tool_call>python<arg_key>code</arg_key><arg_value>print(123*456)</arg_value></tool_call>"
        "<|endoftext|>"
        "<|observation|><tool_response>56088</tool_response>"
        "<|assistant|>56088<|endoftext|>"
    )


def test_generation_prompt_and_json_string_arguments():
    tok = build_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>1+2<|assistant|>"
    # OpenAI wire format sends arguments as a JSON string; it is rendered verbatim inside arg_value.
    call = {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(1)"}'}}
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
    )
    assert rendered.endswith('<tool_call>python<arg_value>{"code": "print(1)"}</arg_value></tool_call><|endoftext|>')
