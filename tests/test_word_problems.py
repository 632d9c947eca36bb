"""The shipped example dataset (configs/data/word_problems*.jsonl) and the script that makes it."""

from __future__ import annotations

import importlib.util
import json
import operator
import re
import sys
from pathlib import Path

import pytest

from asyncrl.configs.schema import TinyModelConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "configs" / "data"
SCRIPT = ROOT / "scripts" / "make_word_problems.py"
PRINTABLE = re.compile(r"[ -~]*")
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)\.")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_word_problems", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]


@pytest.fixture(scope="module")
def rl_rows() -> list[dict]:
    return _read(DATA / "word_problems.jsonl")


@pytest.fixture(scope="module")
def sft_rows() -> list[dict]:
    return _read(DATA / "word_problems_sft.jsonl")


def test_the_script_rewrites_the_shipped_files_byte_for_byte(script, tmp_path) -> None:
    rl_path, sft_path = script.write(tmp_path)
    assert rl_path.read_bytes() == (DATA / "word_problems.jsonl").read_bytes()
    assert sft_path.read_bytes() == (DATA / "word_problems_sft.jsonl").read_bytes()


def test_the_seed_decides_the_problems(script) -> None:
    assert script.generate(seed=3, rows=200) == script.generate(seed=3, rows=200)
    assert script.generate(seed=3, rows=200) != script.generate(seed=4, rows=200)


def test_files_are_small_and_hold_a_few_thousand_distinct_questions(rl_rows, sft_rows) -> None:
    assert 2000 <= len(rl_rows) <= 5000
    assert len({row["question"] for row in rl_rows}) == len(rl_rows)
    for name in ("word_problems.jsonl", "word_problems_sft.jsonl"):
        assert (DATA / name).stat().st_size < 600_000, name


def test_rows_are_printable_ascii_and_short(rl_rows, sft_rows, script) -> None:
    # Every printable ASCII character is one token of the tiny policy; anything else has no token.
    bound = TinyModelConfig().max_position_embeddings // 3
    assert bound >= script.MAX_CHARS
    for row in rl_rows:
        assert set(row) == {"question", "answer", "split"}
        assert PRINTABLE.fullmatch(row["question"]) and PRINTABLE.fullmatch(row["answer"])
    for row in sft_rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert PRINTABLE.fullmatch(user["content"]) and PRINTABLE.fullmatch(assistant["content"])
        assert len(assistant["content"]) <= script.MAX_SOLUTION_CHARS
        assert len(user["content"]) + len(assistant["content"]) <= script.MAX_CHARS


def _check_solution(question: str, solution: str) -> int:
    """Recompute the worked solution: each equation right, chained, on the question's numbers, ending in its result."""
    *equations, final = solution.split(". ")
    steps = EQUATION.findall(solution)
    assert len(steps) == len(equations) in (1, 2), solution
    operands = [int(steps[0][0])]
    previous: int | None = None
    for left, op, right, result in steps:
        if previous is not None:
            assert int(left) == previous, f"{solution}: a step must start from the previous result"
        value = OPS[op](int(left), int(right))
        assert value == int(result) and value >= 0, solution
        operands.append(int(right))
        previous = int(result)
    assert [int(n) for n in re.findall(r"\d+", question)] == operands, f"{question} -> {solution}"
    assert previous is not None and final == f"The answer is {previous}.", solution
    return previous


def test_worked_solutions_and_answers_are_right(rl_rows, sft_rows, script) -> None:
    answers = {row["question"]: row["answer"] for row in rl_rows}
    for row in sft_rows:
        user, assistant = row["messages"]
        assert str(_check_solution(user["content"], assistant["content"])) == answers[user["content"]]
    # The held-out rows have no SFT row: recompute their answers from the generator's own solutions.
    for problem in script.generate():
        assert str(_check_solution(problem["question"], problem["solution"])) == problem["answer"]


def _arithmetic(solution: str) -> str:
    """The problem without its story, read back from the worked solution: `5+3-2`."""
    steps = EQUATION.findall(solution)
    return steps[0][0] + "".join(op + right for _, op, right, _ in steps)


def test_the_heldout_split_is_non_empty_disjoint_and_kept_out_of_sft(rl_rows, sft_rows, script) -> None:
    splits = [row["split"] for row in rl_rows]
    assert set(splits) == {"train", "test"}
    assert 0.05 <= splits.count("test") / len(splits) <= 0.2
    # Disjoint on the arithmetic, not only the wording: a held-out problem never reaches training reworded.
    problems = script.generate()
    assert [p["question"] for p in problems] == [r["question"] for r in rl_rows]
    test = {_arithmetic(p["solution"]) for p in problems if p["split"] == "test"}
    train = {_arithmetic(p["solution"]) for p in problems if p["split"] == "train"}
    assert test and train and not (test & train)
    sft_questions = [row["messages"][0]["content"] for row in sft_rows]
    assert sft_questions == [r["question"] for r in rl_rows if r["split"] == "train"]


def test_the_presets_data_paths_resolve_from_any_working_directory(tmp_path, monkeypatch):
    from asyncrl.configs.loader import load_config
    from asyncrl.configs.paths import data_path

    monkeypatch.chdir(tmp_path)  # not the repository root: the shipped files are found beside the presets
    config = load_config("dataset_example", [])
    paths = [spec.options["path"] for spec in config.tasks.mix.values()] + [config.sft.data.path]
    assert paths and all(data_path(p).is_file() for p in paths), paths
    assert data_path("no/such/file.jsonl") == Path("no/such/file.jsonl")  # the caller's error names what was given
