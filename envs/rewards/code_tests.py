"""Code tests: the row's unit tests run against the model's code in the episode's sandbox; reward = pass fraction.

The code is the last (or first, `block`) fenced ```python block of the completion (```py, ```python3
and untagged fences count too; a fence cut off by the token budget runs to the end), or the whole
completion when it has no fenced block (unless `require_block`).

Tests (`task.tests`) come in two forms:
- a list of strings: each string is one test, python source run after the code in its namespace;
  it passes when it runs without an exception and, if it defines functions named `test*`, each of
  them returns without one (`["assert add(1, 2) == 3", "def test_neg():\\n    assert add(-1, 1) == 0"]`);
- one string: split into tests by its top-level statements: each `assert` and each `def test*`
  function is one test; everything else (imports, helpers, constants) is setup run before each.

Each test is its own sandbox call (`run_python`, under the per-test `timeout_s`), so a test that
hangs, crashes the interpreter or exhausts a limit costs only itself. The code runs as the module
`solution` (tests may import it; its `if __name__ == "__main__":` block does not run) with its
prints discarded, so a chatty solution cannot fill the output cap. A test ends as `passed`,
`failed` (an AssertionError in the test), `error` (any other exception, in the code or the test;
`phase` says which), `timeout` (killed at the time limit) or `crashed` (the interpreter died:
`killed` says why when a limit did: memory, pids, output), or `skipped` (not run: `max_timeouts`).

`details`: `passed`, `failed`, `error`, `timeout`, `crashed`, `skipped` (counts), `total`, `correct` (all
passed), `unparsed`, and `tests`: one dict per test (`outcome`, and `phase`, `error`, `killed`,
`exit_code`, `stderr` where they apply).

The verdict line carries a random nonce, so printing a fake verdict, or exiting early with status 0,
does not pass. Code that deliberately inspects the runner's frames could still read it: these are
unit tests, not a proof of correctness against an adversary inside the same interpreter.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from typing import TYPE_CHECKING, Any, Literal

from .answers import task_field
from .base import RewardError, RewardResult

if TYPE_CHECKING:
    from ..sandbox import Sandbox, ToolResult

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

# Run inside the sandbox. `report` writes to the real stdout fd: the code's own prints go to a sink.
_RUNNER = r"""
def _asyncrl_run(solution, test, nonce):
    import json, os, sys, types
    def report(outcome, phase=None, error=None):
        os.write(1, ("\n" + nonce + json.dumps({"outcome": outcome, "phase": phase, "error": error}) + "\n").encode())
    def describe(e):
        return (type(e).__name__ + (": " + str(e) if str(e) else ""))[:300]
    sys.stdout = open(os.devnull, "w")
    sys.modules["solution"] = module = types.ModuleType("solution")  # tests may also `from solution import f`
    namespace = module.__dict__
    try:
        exec(compile(solution, "<solution>", "exec"), namespace)
    except SystemExit as e:
        if e.code not in (None, 0):
            return report("error", "solution", describe(e))
    except BaseException as e:
        return report("error", "solution", describe(e))
    before = dict(namespace)
    try:
        exec(compile(test, "<test>", "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test") and callable(value) and before.get(name) is not value:
                value()
    except AssertionError as e:
        return report("failed", "test", describe(e))
    except BaseException as e:
        return report("error", "test", describe(e))
    report("passed")
"""

OUTCOMES = ("passed", "failed", "error", "timeout", "crashed", "skipped")


def extract_code(completion: str, block: Literal["first", "last"] = "last") -> str | None:
    """The fenced python block the completion's code is taken from; None when it has none."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion)]
    if not blocks:
        return None
    return blocks[-1] if block == "last" else blocks[0]


def split_tests(tests: Any) -> list[str]:
    """The task's tests as a list of sources, one a test (the forms the module docstring lists)."""
    if isinstance(tests, (list, tuple)):
        if not all(isinstance(t, str) for t in tests):
            raise RewardError("tests must be python source strings")
        return [t for t in tests if t.strip()]
    if not isinstance(tests, str):
        raise RewardError(f"tests must be a string or a list of strings, not {type(tests).__name__}")
    try:
        module = ast.parse(tests)
    except SyntaxError as e:
        raise RewardError(f"the task's tests are not valid python: {e}") from e
    setup: list[ast.stmt] = []
    cases: list[ast.stmt] = []
    for node in module.body:
        test_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
        (cases if test_function or isinstance(node, ast.Assert) else setup).append(node)
    prelude = "\n".join(ast.unparse(node) for node in setup)
    return [f"{prelude}\n{ast.unparse(node)}" if prelude else ast.unparse(node) for node in cases]


class CodeTestsReward:
    """Pass fraction of the task's unit tests against the model's code, each test a sandbox call.

    Options: `timeout_s` (wall-clock limit of each test; None: the sandbox's `timeout_s`), `block`
    (`last` or `first` fenced block), `require_block` (a completion without a fenced block scores 0,
    unparsed, instead of running as code), `max_timeouts` (after this many tests timed out, the rest
    are `skipped`, not run, and count as not passed: code that hangs on every test then costs a few
    timeouts, not one per test; None: run them all)."""

    needs_sandbox = True

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        block: Literal["first", "last"] = "last",
        require_block: bool = False,
        max_timeouts: int | None = None,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
        if max_timeouts is not None and max_timeouts < 1:
            raise ValueError(f"max_timeouts must be at least 1 (or None), not {max_timeouts!r}")
        if block not in ("first", "last"):
            raise ValueError(f"block must be 'first' or 'last', not {block!r}")
        self.timeout_s, self.block, self.require_block, self.max_timeouts = timeout_s, block, require_block, max_timeouts

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any, sandbox: Sandbox | None = None) -> RewardResult:
        if sandbox is None:
            raise RewardError("the code_tests reward runs tests in a sandbox, and none was given (the environment must open one)")
        tests = task_field(task, "tests")
        cases = split_tests(tests) if tests is not None else []
        if not cases:
            raise RewardError("the task has no tests for the code_tests reward")
        code = extract_code(completion_text, self.block)
        if code is None and self.require_block:
            return RewardResult(0.0, {"correct": False, "unparsed": True, "total": len(cases), "passed": 0})
        solution = completion_text if code is None else code
        results: list[dict] = []
        for case in cases:
            timeouts = sum(r["outcome"] == "timeout" for r in results)
            skip = self.max_timeouts is not None and timeouts >= self.max_timeouts
            results.append({"outcome": "skipped"} if skip else await self._run(sandbox, solution, case))
        counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in OUTCOMES}
        details = {"correct": counts["passed"] == len(cases), "unparsed": False, "total": len(cases), **counts, "tests": results}
        return RewardResult(counts["passed"] / len(cases), details)

    async def _run(self, sandbox: Sandbox, solution: str, test: str) -> dict:
        nonce = f"@@asyncrl-test-{secrets.token_hex(16)}@@"
        program = f"{_RUNNER}\n_asyncrl_run({solution!r}, {test!r}, {nonce!r})\n"
        return verdict(await sandbox.run_python(program, timeout_s=self.timeout_s), nonce)


def verdict(result: ToolResult, nonce: str) -> dict:
    """One test's outcome from its sandbox call: the runner's verdict line, or how the call ended."""
    found = None
    if result.exit_code == 0 and result.killed is None:
        for line in result.stdout.splitlines():
            if line.startswith(nonce):
                found = json.loads(line[len(nonce) :])
    if found is not None:
        return {key: value for key, value in found.items() if value is not None}
    outcome = "timeout" if result.killed == "timeout" or result.timed_out else "crashed"
    ended = {"outcome": outcome, "killed": result.killed, "exit_code": result.exit_code, "stderr": result.stderr[-300:] or None}
    return {key: value for key, value in ended.items() if value is not None}
