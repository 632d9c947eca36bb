"""configs/templates/smollm2_tools.jinja: SmolLM2's ChatML template with Hermes tool calls (the agentic
preset's, configs/smollm2_agentic.yaml), on a tokenizer of SmolLM2's shape class (tests/gguf_model.py).

Without tools it must render exactly what the model's own template renders (the model was tuned on that);
with tools, the gateway's `auto` parser must pick the parser that reads its calls back, and an SFT
demonstration must train on exactly the call and the answer the model is later asked to write."""

from __future__ import annotations

import json

import pytest
from gguf_model import SMOLLM2_TEMPLATE, tiny_smollm2

from asyncrl.configs.loader import load_config
from asyncrl.configs.paths import data_path
from asyncrl.envs.tool_demos import PYTHON_TOOL, ToolProblem
from asyncrl.gateway.parsers.auto import resolve
from asyncrl.gateway.parsers.json_calls import HermesParser
from asyncrl.learner.sft_data import render_demo
from asyncrl.policy.validate import read_chat_template

TEMPLATE = "configs/templates/smollm2_tools.jinja"


@pytest.fixture(scope="module")
def tokenizers():
    _, own = tiny_smollm2()
    _, tools = tiny_smollm2()
    tools.chat_template = read_chat_template(TEMPLATE)
    return own, tools


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ],
)
def test_without_tools_it_renders_what_the_models_own_template_renders(tokenizers, messages):
    own, tools = tokenizers
    assert own.chat_template == SMOLLM2_TEMPLATE
    for prompt in (True, False):
        expected = own.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert tools.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == expected


def test_the_gateway_reads_back_the_calls_it_renders(tokenizers):
    _, tools = tokenizers
    assert resolve("auto", tools) == "hermes"
    problem = ToolProblem(123, 4567)
    conversation = problem.demonstration()
    text = tools.apply_chat_template(conversation, tools=[PYTHON_TOOL], tokenize=False)
    assert json.dumps(PYTHON_TOOL) in text and "<tool_response>\n561741\n</tool_response>" in text
    call_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = HermesParser().parse_text(call_turn, [PYTHON_TOOL], lambda: "call-1")
    assert parsed.parse_error is None and parsed.content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("python", {"code": problem.code})
    ]


def test_a_demonstration_trains_on_the_call_and_the_answer_only(tokenizers):
    _, tools = tokenizers
    problem = ToolProblem(321, 99)
    demo = render_demo(tools, problem.demonstration(), [PYTHON_TOOL])
    trained = [token for token, weight in zip(demo.token_ids, demo.loss_mask, strict=True) if weight]
    text = tools.decode(trained)
    # Each turn ends as ChatML ends it, with its newline (the engine stops at <|im_end|> before writing it).
    call = f'<tool_call>\n{{"name": "python", "arguments": {{"code": "{problem.code}"}}}}\n</tool_call>'
    assert text == f"{call}<|im_end|>\n{problem.answer}<|im_end|>\n"


def test_the_agentic_preset_names_the_template_and_its_file_is_found():
    config = load_config("smollm2_agentic", [])
    assert config.policy.chat_template == TEMPLATE and data_path(TEMPLATE).is_file()
    assert config.sft_warm_start and config.sft.task == "agentic"
