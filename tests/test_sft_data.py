"""SFT from chat files (`sft.data`): reading JSONL, Parquet and datasets directories, the assistant-only
mask checked token by token, marker text kept as text, packing, the held-out loss, the mix with the
built-in demonstrations, bad input, and a short real `run_sft`."""

from __future__ import annotations

import json
import random

import datasets
import pytest
import torch

from asyncrl.configs.loader import ConfigError, load_config
from asyncrl.configs.schema import RunConfig, SFTDataConfig, TinyModelConfig
from asyncrl.gateway.template import chat_template
from asyncrl.jobs.sft import chat_rows, demo_stream, gateway_form, run_sft
from asyncrl.learner.sft import evaluation_loss, pack, train_step
from asyncrl.learner.sft_data import MixedStream, render_demo
from asyncrl.learner.sft_rows import ChatDataError, ChatRows
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.tokenizer import ASSISTANT, build_tokenizer

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)
TOK = build_tokenizer()
PYTHON = {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}
TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6*7? Say <|assistant|> if unsure."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "python", "arguments": json.dumps({"code": "print(6*7)"})}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ],
    "tools": [PYTHON],
}  # fmt: skip
PLAIN_ROW = {"messages": [{"role": "user", "content": "Echo <tool_call>"}, {"role": "assistant", "content": "<|endoftext|> <tool_call>"}]}


def marker(text: str) -> list[int]:
    token = TOK.convert_tokens_to_ids(text)
    assert TOK.convert_ids_to_tokens(token) == text
    return [token]


def chars(text: str) -> list[int]:
    """Plain-text tokens, one per character (the tiny tokenizer), whatever marker text they spell."""
    return [TOK.convert_tokens_to_ids(c) for c in text]


def expected(pieces: list[tuple[list[int], int]]) -> tuple[list[int], list[int]]:
    ids = [token for tokens, _ in pieces for token in tokens]
    return ids, [trained for tokens, trained in pieces for _ in tokens]


TOOL_ROW_TOKENS = expected([
    (marker("<|system|>") + chars("tools: python"), 0),
    (marker("<|system|>") + chars("Be brief."), 0),
    (marker("<|user|>") + chars("6*7? Say <|assistant|> if unsure."), 0),
    (marker("<|assistant|>"), 0),
    (marker("<tool_call>") + chars("python") + marker("<arg_key>") + chars("code") + marker("</arg_key>")
     + marker("<arg_value>") + chars("print(6*7)") + marker("</arg_value>") + marker("</tool_call>") + marker("<|endoftext|>"), 1),
    (marker("<|observation|>") + marker("<tool_response>") + chars("42") + marker("</tool_response>"), 0),
    (marker("<|assistant|>"), 0),
    (chars("It is 42.") + marker("<|endoftext|>"), 1),
])  # fmt: skip
PLAIN_ROW_TOKENS = expected([
    (marker("<|user|>") + chars("Echo <tool_call>"), 0),
    (marker("<|assistant|>"), 0),
    (chars("<|endoftext|> <tool_call>") + marker("<|endoftext|>"), 1),
])  # fmt: skip


def write(rows: list, path, kind: str = "jsonl"):
    if kind == "jsonl":
        path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    elif kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def load(path: str, **options) -> ChatRows:
    """The rows as `run_sft` reads them (the gateway's rendering and message normalisation)."""
    return chat_rows(RunConfig(sft={"data": SFTDataConfig(path=path, **options)}), TOK)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_a_chat_file_trains_exactly_the_assistant_tokens_token_by_token(tmp_path, kind):
    """Each assistant message's content, tool-call markup and EOS are trained; every role header,
    system, user and tool token is not; marker text inside any content is plain character tokens."""
    suffix = {"jsonl": ".jsonl", "parquet": ".parquet", "datasets": ""}[kind]
    rows = load(write([TOOL_ROW, PLAIN_ROW], tmp_path / f"chat{suffix}", kind))
    assert rows.skipped == {} and rows.heldout == []
    assert [(d.token_ids, d.loss_mask) for d in rows.train] == [TOOL_ROW_TOKENS, PLAIN_ROW_TOKENS]


def test_marker_text_in_content_renders_as_text_as_the_gateway_renders_it():
    messages, tools = gateway_form(TOOL_ROW["messages"], TOOL_ROW["tools"])
    demo = render_demo(chat_template(TOK), messages, tools)
    assert demo.token_ids.count(marker(ASSISTANT)[0]) == 2  # the two real assistant headers only
    template = chat_template(TOK)
    prompt = template.encode(template.render(messages[:2], tools, generation_prompt=True))
    assert demo.token_ids[: len(prompt)] == prompt  # the gateway's own prompt for the first turn
    # The tokenizer's plain template would have turned the user's text into a fourth assistant header.
    assert render_demo(TOK, messages, tools).token_ids.count(marker(ASSISTANT)[0]) == 3


def test_bad_rows_are_counted_and_skipped_or_refused(tmp_path):
    long_row = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]}
    lines = [
        PLAIN_ROW, "{not json", ["a", "list"], {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "only a question"}]}, {"other": 1}, long_row, "", PLAIN_ROW,
    ]  # fmt: skip
    path = write(lines, tmp_path / "bad.jsonl")
    with open(path, "ab") as file:
        file.write(b"\xff\xfe not UTF-8\n")
    rows = load(path, max_length=256)
    assert len(rows.train) == 2
    assert rows.skipped == {
        "not JSON": 2, "not an object": 1, "invalid messages": 1, "no assistant message": 1, "no 'messages'": 1,
        "longer than sft.data.max_length=256": 1,
    }  # fmt: skip
    with pytest.raises(ChatDataError, match=r"bad.jsonl:2: not JSON \(sft.data.on_malformed=refuse\)"):
        load(path, on_malformed="refuse")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_missing_messages_column_names_the_columns_the_file_has(tmp_path, kind):
    rows = [{"conversation": PLAIN_ROW["messages"], "id": 1}]
    path = write(rows, tmp_path / f"chat.{kind}", kind)
    with pytest.raises(ChatDataError, match=r"sft.data.messages_column: .* has no column 'messages'; its columns: conversation, id"):
        load(path)
    assert len(load(path, messages_column="conversation").train) == 1


def test_empty_and_unreadable_files_and_empty_heldout_splits_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ChatDataError, match=r"no usable rows in .*empty.jsonl .the file has no rows"):
        load(str(tmp_path / "empty.jsonl"))
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(ChatDataError, match=r"junk.parquet: cannot read it"):
        load(str(tmp_path / "junk.parquet"))
    with pytest.raises(ChatDataError, match="no such file"):
        load(str(tmp_path / "missing.jsonl"))
    one = write([PLAIN_ROW], tmp_path / "one.jsonl")
    with pytest.raises(ChatDataError, match=r"heldout_fraction=0.5 holds out (no row|every row) of 1"):
        load(one, heldout_fraction=0.5)
    with pytest.raises(ChatDataError, match=r"sft.data.eval_path: no usable rows"):
        load(one, eval_path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(ConfigError, match=r"set sft.data.eval_path or sft.data.heldout_fraction, not both"):
        load_config(None, [f"sft.data.path={one}", f"sft.data.eval_path={one}", "sft.data.heldout_fraction=0.1"])


def numbered_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{i}+{i}"}, {"role": "assistant", "content": str(2 * i)}]} for i in range(n)]


def test_heldout_split_is_a_stable_disjoint_hash_fraction(tmp_path):
    path = write(numbered_rows(400), tmp_path / "n.jsonl")
    rows = load(path, heldout_fraction=0.25)
    train, heldout = {tuple(d.token_ids) for d in rows.train}, {tuple(d.token_ids) for d in rows.heldout}
    assert not train & heldout and len(train | heldout) == 400 and 70 < len(heldout) < 130
    shuffled = numbered_rows(400)
    random.Random(0).shuffle(shuffled)
    again = load(write(shuffled, tmp_path / "s.jsonl"), heldout_fraction=0.25)
    assert {tuple(d.token_ids) for d in again.heldout} == heldout  # the row decides, not its place in the file


def test_mixing_fraction_is_respected_and_every_pass_shows_every_row(tmp_path):
    rows = load(write(numbered_rows(50), tmp_path / "n.jsonl")).train
    only = MixedStream(rows, 1.0, None, seed=3).batch(100)
    assert sorted(map(id, only[:50])) == sorted(map(id, rows)) == sorted(map(id, only[50:]))
    config = RunConfig(sft={"tool_demo_fraction": 0.2})
    mixed = MixedStream(rows, 0.3, demo_stream(config, TOK, seed=0, renderer=chat_template(TOK)), seed=3).batch(2000)
    share = sum(any(d is row for row in rows) for d in mixed) / len(mixed)
    assert 0.26 < share < 0.34
    # Seeded; and the built-in demonstrations render the same through the gateway's template as through the tokenizer's.
    again = MixedStream(rows, 0.3, demo_stream(config, TOK, seed=0), seed=3).batch(200)
    assert [d.token_ids for d in again] == [d.token_ids for d in mixed[:200]]
    assert any("<tool_call>" in TOK.decode(d.token_ids) for d in again)


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_packed_step_has_the_loss_and_gradient_of_the_padded_one(tmp_path, arch):
    config = RunConfig(policy={"tiny": TinyModelConfig(arch=arch, **SMALL)})
    # A conversation that opens with the assistant trains its second token: the MTP targets next to a boundary count.
    opening = {
        "messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
    }
    rows = load(write([TOOL_ROW, opening, PLAIN_ROW, opening, *numbered_rows(6)], tmp_path / "c.jsonl")).train
    demos = rows + demo_stream(
        config.model_copy(update={"sft": config.sft.model_copy(update={"tool_demo_fraction": 0.5})}), TOK, seed=1
    ).batch(6)
    packed = pack(demos, 160)
    assert len(packed) < len(demos) // 2 and all(len(r.token_ids) <= 160 for r in packed)
    assert sorted(r.position_ids.count(0) for r in packed) != [1] * len(packed)

    results = []
    for pack_length in (None, 160):
        model, _, mtp = build_policy(config.policy, seed=0)
        loss, aux, tokens = train_step(config, model, mtp, demos, TOK.pad_token_id, pack_length)
        grads = [p.grad.clone() for p in list(model.parameters()) + list(mtp.parameters()) if p.grad is not None]
        results.append((loss, aux, tokens, grads, evaluation_loss(model, demos, TOK.pad_token_id, pack_length)))
    (loss, aux, tokens, grads, held), (p_loss, p_aux, p_tokens, p_grads, p_held) = results
    assert tokens == p_tokens == sum(len(d.token_ids) for d in demos)
    assert p_loss == pytest.approx(loss, rel=1e-5) and p_aux == pytest.approx(aux, rel=1e-5) and p_held == pytest.approx(held, rel=1e-5)
    assert len(grads) == len(p_grads)
    for ours, reference in zip(p_grads, grads, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


def test_short_sft_run_from_a_chat_file_records_the_heldout_loss(tmp_path):
    path = write([TOOL_ROW, PLAIN_ROW, *numbered_rows(40), "{broken"], tmp_path / "chat.jsonl")
    config = load_config(None, [f"policy.tiny.{k}={v}" for k, v in SMALL.items()] + [
        f"runs_dir={tmp_path}", "name=d", "policy.tiny.arch=qwen3", "sft.max_steps=5", "sft.batch_size=6", "sft.eval_every=2",
        "sft.stop_at_accuracy=null", "eval.num_problems=4", "eval.max_tokens=2", "logging.wandb=disabled", "logging.progress=false",
        f"sft.data.path={path}", "sft.data.fraction=0.5", "sft.data.heldout_fraction=0.2", "sft.data.packing=true",
        "sft.data.max_length=256",
    ])  # fmt: skip
    result = run_sft(config)
    assert result.steps == 5
    records = [json.loads(line) for line in (tmp_path / "d" / "sft" / "metrics.jsonl").read_text().splitlines()]
    data = records[0]
    assert data["step"] == 0 and data["data_skipped"] == 1 and data["data_skipped/not JSON"] == 1
    assert data["data_rows"] + data["data_heldout_rows"] == 42 and data["data_heldout_rows"] > 0
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    assert all(r["eval_loss"] > 0 for r in evals) and evals[0]["eval_loss"] != evals[-1]["eval_loss"]


def test_a_template_that_rewrites_old_turns_trains_each_assistant_turn_as_it_was_written():
    import chat_templates

    from asyncrl.learner.sft_data import render_demos

    qwen3 = chat_templates.build("qwen3")  # an assistant turn keeps its (empty) think section only while it is the last
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}
    messages = [
        {"role": "user", "content": "6*7"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    with pytest.raises(ValueError, match="not prefix-stable"):
        render_demo(qwen3, messages, [PYTHON])
    first, second = render_demos(qwen3, messages, [PYTHON])

    def trained(demo) -> str:
        return qwen3.decode([t for t, m in zip(demo.token_ids, demo.loss_mask, strict=True) if m])

    def rendered(upto: int) -> list[int]:
        return qwen3.encode(qwen3.apply_chat_template(messages[:upto], tools=[PYTHON], tokenize=False), add_special_tokens=False)

    # Each is the conversation through its turn as the template renders it then, trained on that turn alone.
    assert first.token_ids == rendered(2) and second.token_ids == rendered(4)
    assert (
        trained(first)
        == '<think>\n\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call><|im_end|>\n'
    )
    assert trained(second) == "<think>\n\n</think>\n\n42<|im_end|>\n"
    # A prefix-stable template keeps one demonstration with both turns trained.
    (whole,) = render_demos(TOK, messages, [PYTHON])
    starts = [j for j in range(1, len(whole.loss_mask)) if whole.loss_mask[j] and not whole.loss_mask[j - 1]]
    assert len(starts) == 2 and whole.token_ids == render_demo(TOK, messages, [PYTHON]).token_ids


def test_demonstrations_longer_than_the_models_positions_are_left_out_and_counted():
    from asyncrl.jobs.sft import demo_stream

    config = RunConfig(sft={"tool_demo_fraction": 0.5})
    lengths = [len(d.token_ids) for d in demo_stream(config, TOK, seed=2).batch(40)]
    limit = sorted(lengths)[len(lengths) // 2]
    capped = demo_stream(config, TOK, seed=2, max_length=limit)
    kept = capped.batch(40)
    assert all(len(d.token_ids) <= limit for d in kept) and capped.too_long > 0
    with pytest.raises(ValueError, match=r"demonstrations in a row are longer than the model's 5 positions"):
        demo_stream(config, TOK, seed=2, max_length=5).next()
