"""`env: dataset`: rows from JSONL, CSV, Parquet and Hugging Face datasets become tasks; the column
mapping and the held-out split are checked at start-up (every error names its file, column or rule);
malformed rows are counted and skipped or refused; a file much larger than a memory budget is
streamed; and episodes run through the real gateway, in front of a scripted engine and a real process
sandbox, or in the real RL loop with balanced books."""

from __future__ import annotations

import asyncio
import csv
import json
import random
import secrets
import shutil
import tracemalloc

import pytest
from gateway_helpers import ScriptedEngine
from loop_helpers import run_config, run_in_process, started

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import ProcessSandboxConfig, RunConfig
from asyncrl.envs.dataset.options import DatasetError
from asyncrl.envs.dataset.readers import ParquetSource
from asyncrl.envs.registry import load_environment
from asyncrl.envs.rewards import RewardResult, rule
from asyncrl.envs.runner import run_recorded_episode
from asyncrl.envs.sandbox import open_backend
from asyncrl.gateway.serving import evaluation_gateway
from asyncrl.gateway.store import open_store
from asyncrl.policy.tokenizer import EOS, build_tokenizer

REWARD = "test_dataset_env:digits"
ROWS = [{"id": f"q{i}", "question": f"{i}+{i}", "answer": str(2 * i), "split": "test" if i % 10 == 0 else "train"} for i in range(200)]


@rule
def digits(prompt_messages, completion_text, task, unparsed_reward: float = 0.0) -> RewardResult:
    """1 when the answer's digits are the row's answer; an answer without digits is unparsed (and a
    reward that still gives it something is overruled: unparsed scores 0)."""
    found = "".join(c for c in completion_text if c.isdigit())
    if not found:
        return RewardResult(unparsed_reward, {"unparsed": True, "correct": False})
    return RewardResult(float(found == str(task.answer)), {"unparsed": False, "correct": found == str(task.answer)})


@rule
def parity(prompt_messages, completion_text, task) -> RewardResult:
    """The parity of what the policy wrote (so a random policy's groups have signal, as CoinEnv's); nothing written is unparsed."""
    if not completion_text.strip():
        return RewardResult(0.0, {"unparsed": True})
    return RewardResult(float(sum(map(ord, completion_text)) % 2), {"unparsed": False})


class SandboxedDigits:
    """A reward that needs the episode's sandbox: it has the answer printed there and compares."""

    needs_sandbox = True

    async def score(self, prompt_messages, completion_text, task, sandbox=None) -> RewardResult:
        found = "".join(c for c in completion_text if c.isdigit())
        if not found:
            return RewardResult(0.0, {"unparsed": True})
        printed = await sandbox.run_python(f"print({int(found)})")
        return RewardResult(float(printed.stdout.strip() == str(task.answer)), {"unparsed": False})


def dataset(options: dict, **context):
    return load_environment("dataset", {"reward": REWARD, **options}, EnvContext(**context))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path, rows):
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path, rows, row_group_size=16):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def prompts(split, n=None) -> set[str]:
    return {split.row(i).messages[-1]["content"] for i in range(len(split) if n is None else n)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same rows in every format the dataset task reads."""
    import datasets

    root = tmp_path_factory.mktemp("formats")
    (root / "array.json").write_text(json.dumps(ROWS))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(root / "saved"))
    (root / "folder").mkdir()
    write_parquet(root / "folder" / "train.parquet", ROWS)
    return {
        "jsonl": write_jsonl(root / "rows.jsonl", ROWS), "csv": write_csv(root / "rows.csv", ROWS),
        "parquet": write_parquet(root / "rows.parquet", ROWS), "hf_disk": root / "saved",
        "hf_file": root / "array.json", "hf_folder": root / "folder",
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "hf_disk", "hf_file", "hf_folder"])
def test_every_format_gives_the_same_tasks_and_split(files, kind, tmp_path):
    env = dataset({"path": str(files[kind]), "prompt_template": "Add: {question}", "hf_cache_dir": str(tmp_path / "cache")})
    reference = dataset({"path": str(files["jsonl"]), "prompt_template": "Add: {question}"})
    assert len(env.train) + len(env.eval) == len(ROWS) and env.report.malformed == 0
    # The hash split is of the prompt, so it is the same whatever file the rows come in.
    assert prompts(env.eval) == prompts(reference.eval) and prompts(env.train) == prompts(reference.train)
    task = env.sample_task(random.Random(5))
    number = int(task.row_id.rsplit(":", 1)[1])  # row ids: file name and row number
    assert task.messages == [{"role": "user", "content": f"Add: {number}+{number}"}] and str(task.answer) == str(2 * number)


def test_columns_map_messages_tests_tools_ids_and_metadata(tmp_path):
    tool = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
    rows = [
        {"chat": [{"role": "user", "content": f"write f{i}"}], "tests": [f"assert f{i}() == {i}"], "tools": json.dumps([tool]),
         "uid": f"u{i}", "source": "gen", "level": i % 3}
        for i in range(40)
    ]  # fmt: skip
    options = {
        "path": str(write_parquet(tmp_path / "code.parquet", rows)), "messages_column": "chat", "system_prompt": "Be brief.",
        "answer_column": None, "tests_column": "tests", "tools_column": "tools", "id_column": "uid",
        "metadata_columns": ["source", "level"],
    }  # fmt: skip
    env = dataset(options)
    row = env.sample_task(random.Random(0))
    i = int(row.row_id.removeprefix("u"))
    assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"write f{i}"}]
    assert row.tests == [f"assert f{i}() == {i}"] and row.tools == [tool] and row.answer is None
    assert row.metadata == {"source": "gen", "level": i % 3}
    assert env.needs_sandbox  # tools are mapped: their calls run in the sandbox
    assert not dataset({"path": options["path"], "messages_column": "chat", "answer_column": None}).needs_sandbox
    assert dataset({**options, "reward": "test_dataset_env:SandboxedDigits", "tools_column": None}).needs_sandbox


def test_csv_records_spanning_lines_and_json_columns_read_back_exactly(tmp_path):
    rows = [{"question": f'line one {i}\nline, two "{i}"', "answer": str(i), "tests": json.dumps([f"assert g({i})"])} for i in range(30)]
    env = dataset({"path": str(write_csv(tmp_path / "multi.csv", rows)), "prompt_column": "question", "tests_column": "tests",
                   "heldout_fraction": 0.3})  # fmt: skip
    read = {env.train.row(i).answer: env.train.row(i) for i in range(len(env.train))}
    read |= {env.eval.row(i).answer: env.eval.row(i) for i in range(len(env.eval))}
    assert len(read) == 30 and all(read[r["answer"]].messages[0]["content"] == r["question"] for r in rows)
    assert read["7"].tests == ["assert g(7)"]


def test_a_missing_column_names_it_and_lists_the_columns(files):
    for kind in ("jsonl", "parquet", "csv"):
        with pytest.raises(
            DatasetError, match=r"has no column 'problem' \(named by prompt_column\); its columns: 'id', 'question', 'answer', 'split'"
        ):
            dataset({"path": str(files[kind]), "prompt_column": "problem"})
    with pytest.raises(DatasetError, match=r"no column 'prompt' \(named by prompt_column \(default\)\)"):
        dataset({"path": str(files["jsonl"])})
    with pytest.raises(DatasetError, match=r"no column 'level' \(named by prompt_template\)"):
        dataset({"path": str(files["jsonl"]), "prompt_template": "{question} at {level}"})


def test_bad_options_name_the_option(files):
    with pytest.raises(DatasetError) as caught:
        dataset({"path": str(files["jsonl"]), "prompt_colum": "question", "heldout_fraction": 0})
    assert "prompt_colum: unknown key (did you mean 'prompt_column'?)" in str(caught.value)
    assert "heldout_fraction: Input should be greater than 0" in str(caught.value)
    for options, message in [
        ({"messages_column": "m", "prompt_column": "q"}, "give messages_column, or prompt_column"),
        ({"split_column": "split", "eval_path": "x.jsonl"}, "the held-out split is given twice"),
        ({"split_column": "split", "heldout_fraction": 0.1}, "heldout_fraction applies only without split_column"),
        ({"prompt_template": "{0} and {question"}, "is not a valid template"),
    ]:
        with pytest.raises(DatasetError, match=message):
            dataset({"path": str(files["jsonl"]), **options})


def test_an_unreadable_file_names_the_file_and_the_readers_error(tmp_path):
    with pytest.raises(DatasetError, match=r"dataset file .*nowhere.jsonl does not exist"):
        dataset({"path": str(tmp_path / "nowhere.jsonl")})
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"cannot read .*broken.parquet as parquet: Arrow\w*: "):
        dataset({"path": str(broken)})
    (tmp_path / "rows.xlsx").write_text("")
    with pytest.raises(DatasetError, match=r"cannot tell the format of .*rows.xlsx"):
        dataset({"path": str(tmp_path / "rows.xlsx")})


def test_malformed_rows_are_skipped_and_reported_or_refused(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in ROWS[:50]]
    lines[3] = "{not json"
    lines[7] = json.dumps(["a", "list"])
    lines[9] = json.dumps({"question": None, "answer": "1"})
    lines[11] = json.dumps({"answer": "1"})
    path.write_text("\n".join(lines) + "\n\n")
    env = dataset({"path": str(path), "prompt_column": "question", "heldout_fraction": 0.3})
    assert env.report.rows == 50 and env.report.malformed == 4 and len(env.train) + len(env.eval) == 46
    assert env.report.examples[0].startswith("row 3: not JSON") and "row 7: a JSON list, not an object" in env.report.examples[1]
    assert env.report.examples[2] == "row 9: column 'question' is empty"
    assert env.report.examples[3] == "row 11: column 'question' is missing (the row's columns: 'answer')"
    assert "skipped 4 malformed rows of 50" in caplog.text
    with pytest.raises(DatasetError, match=r"mixed.jsonl: row 3 is malformed: not JSON .*on_bad_row: error"):
        dataset({"path": str(path), "prompt_column": "question", "on_bad_row": "error"})
    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4", "extra": "x"}]
    short = write_csv(tmp_path / "short.csv", rows[:1])
    short.write_text(short.read_text() + "3+3\n4+4,8,too many\n")
    with pytest.raises(DatasetError, match=r"row 1 is malformed: 1 fields where the header has 2"):
        dataset({"path": str(short), "prompt_column": "question", "on_bad_row": "error"})


def test_held_out_splits_are_disjoint_stable_and_seeded(tmp_path, files):
    env = dataset({"path": str(files["jsonl"]), "prompt_column": "question", "heldout_fraction": 0.2})
    train, held = prompts(env.train), prompts(env.eval)
    assert not train & held and 20 <= len(held) <= 60  # 200 rows, 20% by hash
    shuffled = random.Random(1).sample(ROWS, len(ROWS))
    again = dataset({"path": str(write_jsonl(tmp_path / "shuffled.jsonl", shuffled)), "prompt_column": "question", "heldout_fraction": 0.2})
    assert prompts(again.eval) == held  # by the prompt, not the position: re-ordering keeps the split
    by_id = dataset({"path": str(files["jsonl"]), "prompt_column": "question", "id_column": "id"})
    assert {by_id.eval.row(i).row_id for i in range(len(by_id.eval))} <= {r["id"] for r in ROWS}
    assert [env.sample_task(random.Random(3)) for _ in range(3)] == [env.sample_task(random.Random(3)) for _ in range(3)]
    heldout = env.heldout_tasks(1000, seed=4)
    assert len({t.row_id for t in heldout}) == len(heldout) == len(env.eval) and heldout == env.heldout_tasks(1000, seed=4)
    assert {t.messages[0]["content"] for t in env.heldout_tasks(5, seed=4)} <= held


def test_a_split_column_or_an_eval_file_gives_the_held_out_rows(tmp_path, files):
    by_column = dataset({"path": str(files["parquet"]), "prompt_column": "question", "split_column": "split"})
    assert prompts(by_column.eval) == {r["question"] for r in ROWS if r["split"] == "test"}
    assert prompts(by_column.train) == {r["question"] for r in ROWS if r["split"] == "train"}
    evaluation = write_jsonl(tmp_path / "eval.jsonl", ROWS[:30])
    by_file = dataset({"path": str(files["csv"]), "prompt_column": "question", "eval_path": str(evaluation)})
    assert prompts(by_file.eval) == {r["question"] for r in ROWS[:30]}
    assert prompts(by_file.train) == {r["question"] for r in ROWS[30:]} and by_file.report.overlap == 30  # disjoint
    assert by_file.eval.row(0).row_id == "eval.jsonl:" + str(by_file.eval.numbers[0])
    dupes = [*ROWS[:20], {**ROWS[0], "split": "train"}]  # the same prompt marked both ways: held out only
    by_dupes = dataset({"path": str(write_jsonl(tmp_path / "d.jsonl", dupes)), "prompt_column": "question", "split_column": "split"})
    assert by_dupes.report.overlap == 1 and ROWS[0]["question"] not in prompts(by_dupes.train)


def test_a_hugging_face_dataset_dict_gives_its_splits(tmp_path):
    import datasets

    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[20:]), "test": datasets.Dataset.from_list(ROWS[:20])}).save_to_disk(
        str(saved)
    )
    env = dataset({"path": str(saved), "prompt_column": "question", "hf_eval_split": "test"})
    assert prompts(env.eval) == {r["question"] for r in ROWS[:20]} and len(env.train) == 180
    assert env.eval.row(0).row_id == f"dict[test]:{env.eval.numbers[0]}" and env.train.row(0).row_id == f"dict:{env.train.numbers[0]}"
    with pytest.raises(DatasetError, match=r"has no split 'valid'; its splits: train, test"):
        dataset({"path": str(saved), "prompt_column": "question", "hf_eval_split": "valid"})


def test_an_empty_dataset_or_split_is_refused_at_start_up(tmp_path, files):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match=r"dataset .*empty.jsonl has no usable rows \(0 read\)"):
        dataset({"path": str(empty), "prompt_column": "question"})
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("nope\n[]\n")
    with pytest.raises(DatasetError, match=r"garbage.jsonl has no usable rows \(2 read; 2 malformed, first: row 0: not JSON"):
        dataset({"path": str(garbage), "prompt_column": "question"})
    with pytest.raises(
        DatasetError, match=r"the held-out split of dataset .*rows.jsonl is empty under split_column 'split' .* seen: \{'test': 20\}"
    ):
        dataset(
            {
                "path": str(files["jsonl"]),
                "prompt_column": "question",
                "split_column": "split",
                "eval_values": ["dev"],
                "train_values": ["train"],
            }
        )
    with pytest.raises(DatasetError, match=r"the held-out split of dataset .*two.jsonl is empty under heldout_fraction 1e-09"):
        dataset({"path": str(write_jsonl(tmp_path / "two.jsonl", ROWS[:2])), "prompt_column": "question", "heldout_fraction": 1e-9})


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_file_much_larger_than_the_memory_budget_is_streamed(tmp_path, kind):
    """40 MB of rows scanned and sampled under a 4 MB budget of Python allocations: only offsets are kept."""
    budget, padding = 4_000_000, "x" * 4000
    rows = [{"question": f"{i}*2", "answer": str(2 * i), "notes": padding} for i in range(10_000)]
    path = (write_jsonl if kind == "jsonl" else write_csv)(tmp_path / f"big.{kind}", rows)
    del rows
    assert path.stat().st_size > 10 * budget
    tracemalloc.start()
    try:
        env = dataset({"path": str(path), "prompt_column": "question", "metadata_columns": ["notes"]})
        rng = random.Random(0)
        tasks = [env.sample_task(rng) for _ in range(200)] + env.heldout_tasks(50, seed=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < budget, f"peak {peak} bytes while reading a {path.stat().st_size} byte file"
    assert len(env.train) + len(env.eval) == 10_000 and all(t.answer == str(2 * int(t.messages[0]["content"][:-2])) for t in tasks)
    assert tasks[0].metadata["notes"] == padding


def test_a_parquet_file_is_decoded_one_row_group_at_a_time(tmp_path):
    """Arrow's own allocations (not seen by tracemalloc) stay near one row group's while a file many times larger is scanned and sampled."""
    import pyarrow as pa

    rows = [{"question": f"{i}*2", "answer": str(2 * i), "notes": secrets.token_hex(2000)} for i in range(12_000)]
    path = write_parquet(tmp_path / "big.parquet", rows, row_group_size=125)  # ~0.5 MB a row group
    del rows
    budget = 8_000_000  # a few row groups' worth: compressed chunks, decoded pages, the group kept for reads
    assert path.stat().st_size > 6 * budget
    base, peak = pa.total_allocated_bytes(), 0
    source = ParquetSource(str(path))
    source.select(["question", "answer", "notes"])
    for position, _row in source.scan():
        if position % 50 == 0:
            peak = max(peak, pa.total_allocated_bytes() - base)
    rng = random.Random(0)
    for _ in range(100):
        row = source.read(rng.randrange(12_000))
        peak = max(peak, pa.total_allocated_bytes() - base)
    assert peak < budget, f"{peak} bytes of Arrow memory for a {path.stat().st_size} byte file"
    assert row["answer"] == str(2 * int(row["question"][:-2])) and len(row["notes"]) == 4000


def _call(code: str) -> str:
    from asyncrl.policy.tokenizer import ARG_KEY_CLOSE, ARG_KEY_OPEN, ARG_VALUE_CLOSE, ARG_VALUE_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

    return f"{TOOL_CALL_OPEN}python{ARG_KEY_OPEN}code{ARG_KEY_CLOSE}{ARG_VALUE_OPEN}{code}{ARG_VALUE_CLOSE}{TOOL_CALL_CLOSE}{EOS}"


def _episode(env, task, replies: list[str]):
    remaining = list(replies)
    engine = ScriptedEngine(lambda _prompt: remaining.pop(0))
    sandboxes = open_backend(ProcessSandboxConfig()) if env.needs_sandbox else None

    async def go():
        async with evaluation_gateway(RunConfig(), [engine], build_tokenizer()) as gateway:
            return (await run_recorded_episode(env, task, gateway, sandboxes=sandboxes, evaluation=True))[1]

    return asyncio.run(go())


def test_episodes_score_through_the_gateway_and_an_unparsed_answer_scores_zero(files):
    env = dataset({"path": str(files["jsonl"]), "prompt_column": "question", "reward_options": {"unparsed_reward": 0.5}})
    task = env.sample_task(random.Random(2))
    right = _episode(env, task, [f"{task.answer}{EOS}"])
    assert right.status == "ok" and right.reward == 1.0 and right.metrics["correct"] and not right.metrics["unparsed"]
    assert right.metrics["row_id"] == task.row_id
    unparsed = _episode(env, task, [f"no idea{EOS}"])
    assert unparsed.status == "ok" and unparsed.reward == 0.0 and unparsed.metrics["unparsed"] and not unparsed.metrics["correct"]


def test_the_default_reward_is_math_verify_and_an_unreadable_answer_counts_as_unparsed(tmp_path):
    rows = [{"question": f"Half of {i}/{i}?", "answer": "\\frac{1}{2}"} for i in range(1, 41)]
    env = load_environment(
        "dataset", {"path": str(write_jsonl(tmp_path / "half.jsonl", rows)), "prompt_column": "question", "max_tokens": 32}
    )
    task = env.sample_task(random.Random(0))
    for reply in ("0.5", "1/2", "so \\boxed{\\frac{2}{4}}"):
        result = _episode(env, task, [reply + EOS])
        assert (result.status, result.reward, result.metrics["correct"], result.metrics["unparsed"]) == ("ok", 1.0, True, False), reply
    wrong, unreadable = _episode(env, task, [f"0.25{EOS}"]), _episode(env, task, [f"no idea{EOS}"])
    assert (wrong.reward, wrong.metrics["correct"], wrong.metrics["unparsed"]) == (0.0, False, False)
    assert (unreadable.status, unreadable.reward, unreadable.metrics["unparsed"]) == ("ok", 0.0, True)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the process sandbox needs bubblewrap")
def test_a_row_with_tools_runs_its_python_calls_in_the_sandbox(tmp_path):
    tools = [
        {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}
    ]
    rows = [{"question": f"6*7 (#{i})", "answer": "42", "tools": tools} for i in range(40)]
    env = dataset(
        {
            "path": str(write_jsonl(tmp_path / "tools.jsonl", rows)),
            "prompt_column": "question",
            "tools_column": "tools",
            "max_turns": 2,
            "max_tokens": 64,
        }
    )
    task = env.sample_task(random.Random(0))
    result = _episode(env, task, [_call("print(6*7)"), f"42{EOS}"])
    assert result.status == "ok" and result.reward == 1.0
    assert result.metrics["tool_calls"] == 1 and result.metrics["answered"] is True
    looping = _episode(env, task, [_call("print(1)"), _call("print(2)")])
    assert looping.metrics["answered"] is False and looping.metrics["tool_calls"] == 2 and looping.metrics["unparsed"]
    scored_there = dataset(
        {"path": str(tmp_path / "tools.jsonl"), "prompt_column": "question", "reward": "test_dataset_env:SandboxedDigits"}
    )
    assert scored_there.needs_sandbox and _episode(scored_there, task, [f"42{EOS}"]).reward == 1.0


def test_the_dataset_env_meets_the_environment_contract(files):
    from asyncrl.jobs.contract import check_environment

    env = dataset(
        {"path": str(files["parquet"]), "prompt_template": "Add: {question}", "reward": "test_dataset_env:parity", "max_tokens": 4}
    )
    report = check_environment(env, episodes=3, eval_episodes=2)
    assert len(report.results) == 3 and all(isinstance(r.metrics["unparsed"], bool) for r in report.results)


def test_a_dataset_task_trains_in_the_real_loop_with_balanced_books(tmp_path, files):
    options = {"path": str(files["jsonl"]), "prompt_column": "question", "reward": "test_dataset_env:parity", "max_tokens": 4}
    mix = f"tasks.mix={json.dumps({'data': {'env': 'dataset', 'options': options, 'eval_problems': 8}})}"
    config = run_config(tmp_path, "name=data", "loop.steps=2", mix)
    result = asyncio.run(run_in_process(config, None))
    state, counts = result["state"], result["counts"]
    assert state.version == 2 and sum(state.ledger.values()) == started(counts) > 0 and state.ledger["trained"] > 0
    store = open_store(result["rundir"].store_address(config), namespace=config.name)
    try:
        done = [t for t in store.list() if t.status == "ok"]
    finally:
        store.close()
    assert done and {t.task for t in done} == {"data"}
    assert all(isinstance(t.metrics["unparsed"], bool) and (t.reward == 0.0 or not t.metrics["unparsed"]) for t in done)
    assert any("eval_accuracy" in r for r in result["records"])
