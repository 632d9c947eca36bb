"""Token-exact multi-turn: prompts reuse earlier turns bit for bit; rewrites fork, both branches kept."""

from __future__ import annotations

import json

import pytest

from asyncrl.gateway.conversation import Conversation, ConversationError
from asyncrl.gateway.toolcalls import MessageError, parse_completion, to_template_messages
from asyncrl.policy.tokenizer import EOS, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = {"role": "system", "content": "You can run python."}
USER = {"role": "user", "content": "123*456"}


class RecordingTokenizer:
    """The real tokenizer, remembering every text it was asked to encode."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.encoded, self.renders = tokenizer, [], 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def base_tok():
    return build_tokenizer()


@pytest.fixture
def tok(base_tok):
    return RecordingTokenizer(base_tok)


def chars(tok, text: str) -> list[int]:
    """Token ids one character at a time: what a model sampling markup as plain characters produces."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def sample(tok, text: str):
    """(completion token ids, the assistant message the gateway returns for them)."""
    ids = encode(tok, text)
    return ids, parse_completion(ids, tok, TOOLS).message()


def tool_turn(tok, conv, messages, answer="56088"):
    """One tool-call turn: prepare, 'sample', commit; returns messages extended as an agent would."""
    prepared = conv.prepare(messages, TOOLS)
    ids, returned = sample(tok, "<tool_call>python<arg_key> code </arg_key><arg_value>print(123*456)</arg_value></tool_call>" + EOS)
    conv.commit(prepared, ids, returned)
    return prepared, [*messages, json.loads(json.dumps(returned)), {"role": "tool", "tool_call_id": "x", "content": answer}]


def test_first_turn_is_the_rendered_prompt(tok) -> None:
    conv = Conversation(tok)
    branch_id, prompt, turn = conv.prepare([SYSTEM, USER], TOOLS)
    expected = tok.apply_chat_template([SYSTEM, USER], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert (branch_id, turn) == (0, 0)
    assert prompt == encode(tok, expected)
    assert conv.branches == []  # nothing is recorded until a turn is committed


def test_next_turn_starts_with_the_exact_sampled_tokens(tok) -> None:
    conv = Conversation(tok)
    first, messages = tool_turn(tok, conv, [SYSTEM, USER])
    tok.encoded.clear()
    second = conv.prepare(messages, TOOLS)
    completion = encode(tok, "<tool_call>python<arg_key> code </arg_key><arg_value>print(123*456)</arg_value></tool_call>" + EOS)
    suffix = "<|observation|><tool_response>56088</tool_response><|assistant|>"
    # The model wrote " code " with spaces; a re-render would say "code". The prompt keeps what it saw.
    assert second.prompt_token_ids == first.prompt_token_ids + completion + encode(tok, suffix)
    assert (second.branch_id, second.turn_index, second.reused_tokens) == (0, 1, len(first.prompt_token_ids) + len(completion))
    assert tok.encoded[-1:] == [suffix]  # only the new messages were tokenized


def test_a_continuing_turn_renders_the_template_once(tok) -> None:
    # The gateway's hot path: the turn boundary remembers the text its tokens came from, so a turn
    # that extends it needs one render (the full conversation), not a second one of the prefix.
    conv = Conversation(tok)
    prepared = conv.prepare([SYSTEM, USER], TOOLS)
    ids, returned = sample(tok, "<tool_call>python<arg_key>code</arg_key><arg_value>print(1)</arg_value></tool_call>" + EOS)
    conv.commit(prepared, ids, returned)
    messages = [SYSTEM, USER, json.loads(json.dumps(returned)), {"role": "tool", "tool_call_id": "x", "content": "1"}]
    tok.renders = 0
    second = conv.prepare(messages, TOOLS)
    assert tok.renders == 1
    assert second.prompt_token_ids[: len(prepared.prompt_token_ids) + len(ids)] == prepared.prompt_token_ids + ids


def test_completion_tokens_are_kept_even_when_text_would_tokenize_differently(tok) -> None:
    conv = Conversation(tok)
    prepared = conv.prepare([USER])
    # Markup spelled in characters is plain content; encoding its text would give the special token.
    completion = [*chars(tok, "<tool_call>"), tok.eos_token_id]
    returned = parse_completion(completion, tok).message()
    assert returned == {"role": "assistant", "content": "<tool_call>"}
    conv.commit(prepared, completion, returned)
    follow_up = [USER, returned, {"role": "user", "content": "again"}]
    _, prompt, _ = conv.prepare(follow_up)
    assert prompt[: len(prepared.prompt_token_ids) + len(completion)] == prepared.prompt_token_ids + completion
    fresh = encode(tok, tok.apply_chat_template(follow_up, tokenize=False, add_generation_prompt=True))
    assert prompt != fresh and len(prompt) > len(fresh)


def test_echo_variations_do_not_fork(tok) -> None:
    conv = Conversation(tok)
    prepared = conv.prepare([USER], TOOLS)
    call_text = "<tool_call>python<arg_key>b</arg_key><arg_value>2</arg_value><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    ids, returned = sample(tok, "Ok." + call_text + EOS)
    conv.commit(prepared, ids, returned)
    call = returned["tool_calls"][0]
    echoed = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Ok."}],
        "tool_calls": [{"id": "other-id", "type": "function", "function": {"name": "python", "arguments": '{"a":"1",  "b":"2"}'}}],
    }
    assert call["id"] != "other-id"
    branch_id, prompt, _ = conv.prepare([USER, echoed, {"role": "tool", "content": "3"}], TOOLS)
    assert branch_id == 0 and prompt[: len(prepared.prompt_token_ids) + len(ids)] == prepared.prompt_token_ids + ids


def test_edited_history_forks_fresh_and_keeps_both_branches(tok) -> None:
    conv = Conversation(tok)
    _, messages = tool_turn(tok, conv, [SYSTEM, USER])
    before = list(conv.branch(0).token_ids)
    edited = [SYSTEM, {"role": "user", "content": "123*457"}, *messages[2:]]
    prepared = conv.prepare(edited, TOOLS)
    assert prepared.reused_tokens == 0 and prepared.branch_id == 1
    # Fresh means the template renders the (converted) messages: the tool call as markup again.
    rendered = tok.apply_chat_template(to_template_messages(edited), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>python<arg_key>code</arg_key>" in rendered
    assert prepared.prompt_token_ids == encode(tok, rendered)
    assert conv.commit(prepared, encode(tok, "x" + EOS), {"role": "assistant", "content": "x"}) == 1
    assert [b.id for b in conv.branches] == [0, 1]
    assert conv.branch(0).token_ids == before
    assert (conv.branch(1).parent, conv.branch(1).fork_reason) == (None, "rewrite")


def test_dropped_turns_fork_from_the_last_shared_turn(tok) -> None:
    conv = Conversation(tok)
    _first, turn2 = tool_turn(tok, conv, [SYSTEM, USER])
    _second, turn3 = tool_turn(tok, conv, turn2, answer="0")
    shared = conv.branch(0).marks[len(turn2) - 1]  # tokens through the first assistant message
    # The agent throws away the second turn and retries it with another tool result.
    retry = [*turn2[:-1], {"role": "tool", "content": "56088!"}]
    prepared = conv.prepare(retry, TOOLS)
    assert prepared.branch_id == 1 and prepared.reused_tokens == shared
    assert prepared.prompt_token_ids[:shared] == conv.branch(0).token_ids[:shared]
    assert conv.commit(prepared, encode(tok, "1" + EOS), {"role": "assistant", "content": "1"}) == 1
    fork = conv.branch(1)
    assert (fork.parent, fork.fork_reason, fork.turns) == (0, "rewrite", 1)
    assert fork.marks[len(turn2) - 1] == shared
    # The original line goes on as before.
    assert conv.prepare(turn3, TOOLS).branch_id == 0


def test_concurrent_turns_on_one_branch_fork_at_commit(tok) -> None:
    conv = Conversation(tok)
    _, messages = tool_turn(tok, conv, [USER])
    a, b = conv.prepare(messages, TOOLS), conv.prepare(messages, TOOLS)
    assert a.branch_id == b.branch_id == 0 and a.prompt_token_ids == b.prompt_token_ids
    assert (a.turn_index, b.turn_index) == (1, 2)
    assert conv.commit(a, encode(tok, "A" + EOS), {"role": "assistant", "content": "A"}) == 0
    assert conv.commit(b, encode(tok, "B" + EOS), {"role": "assistant", "content": "B"}) == 1
    assert (conv.branch(1).parent, conv.branch(1).fork_reason) == (0, "concurrent")
    assert conv.branch(0).token_ids[-2:] == encode(tok, "A" + EOS)
    assert conv.branch(1).token_ids[-2:] == encode(tok, "B" + EOS)
    assert conv.branch(1).token_ids[:-2] == conv.branch(0).token_ids[:-2]


def test_an_abandoned_call_leaves_no_trace(tok) -> None:
    conv = Conversation(tok)
    _, messages = tool_turn(tok, conv, [USER])
    failed = conv.prepare(messages, TOOLS)  # the engine died; never committed
    retried = conv.prepare(messages, TOOLS)
    assert retried.prompt_token_ids == failed.prompt_token_ids and retried.branch_id == 0
    assert len(conv.branches) == 1 and conv.branch(0).turns == 1


def test_changed_tools_start_a_new_branch(tok) -> None:
    conv = Conversation(tok)
    _, messages = tool_turn(tok, conv, [USER])
    prepared = conv.prepare(messages, None)
    assert prepared.reused_tokens == 0 and prepared.branch_id == 1


def test_template_that_rewrites_history_starts_fresh(base_tok) -> None:
    tok = build_tokenizer()
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    conv = Conversation(tok)
    prepared = conv.prepare([USER])
    conv.commit(prepared, encode(tok, "ok"), {"role": "assistant", "content": "ok"})
    again = conv.prepare([USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    assert again.reused_tokens == 0 and again.prompt_token_ids == encode(tok, "3123*456okmore")
    conv.commit(again, [], {"role": "assistant", "content": ""})
    assert conv.branch(again.branch_id).fork_reason == "template"


def test_max_branches(tok) -> None:
    conv = Conversation(tok, max_branches=1)
    _, messages = tool_turn(tok, conv, [USER])
    conv.prepare(messages, TOOLS)  # extending is always allowed
    with pytest.raises(ConversationError, match="max_branches"):
        conv.prepare([{"role": "user", "content": "something else"}], TOOLS)


def test_max_branches_counts_the_branches_calls_in_flight_will_create(tok) -> None:
    conv = Conversation(tok, max_branches=2)
    _, messages = tool_turn(tok, conv, [USER])
    first = conv.prepare(messages, TOOLS)  # extends branch 0
    second = conv.prepare(messages, TOOLS)  # the same messages at once: one of the two forks at commit
    other = [{"role": "user", "content": "something else"}]
    for refused in (messages, other):
        with pytest.raises(ConversationError, match="max_branches"):
            conv.prepare(refused, TOOLS)
    conv.release(second)  # it failed: its reservation is free again
    conv.release(second)  # and giving it back twice changes nothing
    fork = conv.prepare(other, TOOLS)
    with pytest.raises(ConversationError, match="max_branches"):
        conv.prepare(other, TOOLS)
    assert conv.commit(fork, encode(tok, "x" + EOS), {"role": "assistant", "content": "x"}) == 1
    assert conv.commit(first, encode(tok, "A" + EOS), {"role": "assistant", "content": "A"}) == 0
    assert len(conv.branches) == 2


def test_commit_checks_max_branches_again(tok) -> None:
    conv = Conversation(tok)
    a, b = conv.prepare([USER]), conv.prepare([{"role": "user", "content": "other"}])
    conv.max_branches = 1  # e.g. a reservation this conversation did not see
    assert conv.commit(a, encode(tok, "A" + EOS), {"role": "assistant", "content": "A"}) == 0
    with pytest.raises(ConversationError, match="max_branches"):
        conv.commit(b, encode(tok, "B" + EOS), {"role": "assistant", "content": "B"})
    assert [branch.turns for branch in conv.branches] == [1]


def test_a_reply_that_spells_a_marker_is_echoed_with_one_render(tok) -> None:
    conv = Conversation(tok)
    prepared = conv.prepare([USER])
    completion = [*chars(tok, "<|user|>"), tok.eos_token_id]
    returned = parse_completion(completion, tok).message()
    conv.commit(prepared, completion, returned)
    tok.renders = 0
    follow_up = conv.prepare([USER, returned, {"role": "user", "content": "again"}])
    assert tok.renders == 1  # the remembered text reads as the template renders the echoed reply
    assert follow_up.prompt_token_ids[: len(prepared.prompt_token_ids) + len(completion)] == prepared.prompt_token_ids + completion


def test_template_kwargs_are_rendered_and_remembered_per_mark(tok) -> None:
    # The embedded template reads no variables: any kwarg is refused, naming it.
    with pytest.raises(MessageError, match=r"chat_template_kwargs\.enable_thinking: .* reads no variables"):
        Conversation(tok).prepare([USER], TOOLS, {"enable_thinking": False})
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ mode }}:{{ m.content }}{% endfor %}"
    conv = Conversation(tok)
    first = conv.prepare([USER], None, {"mode": "a"})
    assert first.prompt_token_ids == encode(tok, "a:123*456")
    conv.commit(first, encode(tok, "ok" + EOS), {"role": "assistant", "content": "ok"})
    messages = [USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    same = conv.prepare(messages, None, {"mode": "a"})
    assert same.branch_id == 0 and same.reused_tokens == len(conv.branch(0).token_ids)
    # Every earlier turn renders otherwise under "b": the tokens made under "a" are not reused.
    other = conv.prepare(messages, None, {"mode": "b"})
    assert other.reused_tokens == 0 and other.prompt_token_ids == encode(tok, "b:123*456b:okb:more")
    conv.commit(other, encode(tok, "x" + EOS), {"role": "assistant", "content": "x"})
    assert conv.branch(1).fork_reason == "template"
