"""Answer checks against the row's reference answer (`task.answer`): math-verify, exact / normalized, regex.

All three read the reference from `task.answer` (a `DatasetRow`, any object with an `answer`
attribute, or a dict with an `answer` key) and score 1 or 0; `details["correct"]` is what held-out
evaluation counts. An answer from the model that cannot be read (nothing math-verify can parse, no
match for the extracting pattern) scores 0 with `details["unparsed"] = True`; it never raises. A
reference that cannot be read is the data's fault, not the policy's: that raises `RewardError`, so
the episode ends as env_crash and the learner drops it instead of training on a wrong zero.

`MathReward` runs Hugging Face's math-verify (`parse` + `verify`) in a worker process of its own:
sympy can take seconds on a hostile answer (`\\boxed{9^{9^{9^9}}}`), which must block neither the
event loop nor other episodes, and math-verify's own timeouts (SIGALRM) work only in a main thread.
The worker applies them, and the host kills the worker if an answer outlasts them anyway.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from .base import RewardError, RewardResult

_MISSING = object()


def task_field(task: Any, name: str) -> Any:
    """`task.<name>` or `task[name]`; `RewardError` when the task has neither."""
    value = task.get(name, _MISSING) if isinstance(task, dict) else getattr(task, name, _MISSING)
    if value is _MISSING:
        raise RewardError(f"this reward reads the task's {name!r}, which a {type(task).__name__} task does not have")
    return value


def _reference(task: Any) -> Any:
    answer = task_field(task, "answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise RewardError("the task has no reference answer (its answer column is empty)")
    return answer


# --- math-verify -----------------------------------------------------------------------------

_WORKER_MEMORY_MB = 1024
# The worker: one JSON request a line on stdin, one JSON answer a line on stdout. It sees only the
# standard library and math_verify, so a crash or kill here never touches the run.
_WORKER = r"""
import json, resource, sys
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# A hostile answer runs out of memory here (MemoryError: unparsed), not on the machine.
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]) << 20,) * 2)
# Replies go to the real stdout alone; anything a library prints goes to stderr (discarded).
replies, sys.stdout = sys.stdout, sys.stderr

def targets(extract, boxed_first, anchored):
    latex = LatexExtractionConfig(boxed_match_priority=0 if boxed_first else 50, try_extract_without_anchor=not anchored)
    expr = ExprExtractionConfig(try_extract_without_anchor=not anchored)
    return {"any": [latex, expr], "latex": [latex], "expr": [expr]}[extract]

def parsed(text, timeout, config=None):
    # math-verify's parse; None unless it found an expression (it may return only the raw text).
    found = parse(text, parsing_timeout=timeout, **({} if config is None else {"extraction_config": config}))
    return found if any(not isinstance(x, str) for x in found) else None

def check(gold, answer, extract, boxed_first, anchored, timeout):
    # A bare reference ("x+1") is read as LaTeX in $...$ when the plain parse finds no expression.
    gold_expr = parsed(gold, timeout) or parsed("$" + gold + "$", timeout)
    if gold_expr is None:
        return {"gold_unparsed": True}
    answer_expr = parsed(answer, timeout, targets(extract, boxed_first, anchored))
    if answer_expr is None:
        return {"unparsed": True}
    return {"correct": bool(verify(gold_expr, answer_expr, timeout_seconds=timeout)), "extracted": str(answer_expr[-1])[:200]}

replies.write("ready\n"); replies.flush()
for line in sys.stdin:
    try:
        reply = check(**json.loads(line))
    except Exception as error:
        reply = {"unparsed": True, "error": repr(error)[:300]}
    replies.write(json.dumps(reply) + "\n"); replies.flush()
"""
_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine


class _MathWorker:
    """The math-verify process: started on first use, restarted after a kill, gone with its owner.

    Calls run one at a time on a thread of its own, so waiting for the worker never occupies the
    event loop's default executor (the store and the sandboxes use it)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-math-verify")
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        weakref.finalize(self, _MathWorker._shutdown, self.__dict__)

    async def check(self, request: dict, timeout_s: float) -> dict:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._check, request, timeout_s)

    def _check(self, request: dict, timeout_s: float) -> dict:
        if self._proc is not None and self._proc.poll() is not None:
            self._kill()  # it died since the last answer (the OOM killer): start another
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(_WORKER_MEMORY_MB)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )  # its warnings ("Timeout during parsing") would fill a pipe no one reads
            self._buffer = b""
            try:
                ready = self._readline(_START_TIMEOUT_S)
            except EOFError:
                ready = None
            if ready != b"ready":
                self._kill()
                raise RewardError(f"the math-verify worker did not start (in {_START_TIMEOUT_S:.0f}s; is math-verify installed?)")
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            self._kill()
            return {"unparsed": True, "error": "the math-verify worker had exited"}
        try:
            line = self._readline(timeout_s)
        except EOFError:
            self._kill()
            return {"unparsed": True, "error": "the math-verify worker died on this answer"}
        if line is None:
            self._kill()
            return {"unparsed": True, "timed_out": True}
        return json.loads(line)

    def _readline(self, timeout_s: float) -> bytes | None:
        """The worker's next line; None when it does not come within timeout_s, EOFError when the worker died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _kill(self) -> None:
        _MathWorker._shutdown(self.__dict__)

    @staticmethod
    def _shutdown(state: dict) -> None:
        proc, state["_proc"] = state.get("_proc"), None
        if proc is not None:
            proc.kill()
            proc.wait()


class MathReward:
    """1 when math-verify finds the model's answer equal to `task.answer` (1/2 = 0.5 = \\frac{1}{2}), else 0.

    Options: `extract` (`any`: LaTeX, `\\boxed{}` included, and plain expressions; `latex`; `expr`),
    `boxed_first` (a `\\boxed{}` answer wins over other candidates), `anchored` (only answers after
    "answer is", "final answer", or boxed count), `timeout_s` (math-verify's limit on each parse and
    comparison; the worker is killed at 3 x timeout_s + 5 s). A reference with no expression in it
    (even as `$...$` LaTeX) raises `RewardError`.

    `details`: `correct`, `unparsed`, `extracted` (the answer math-verify compared), and
    `timed_out` (the worker was killed) or `error` (what went wrong in it) when those happened.
    Answers are checked one at a time by the reward's one worker: milliseconds each, as a rule."""

    def __init__(
        self, *, extract: Literal["any", "latex", "expr"] = "any", boxed_first: bool = True, anchored: bool = False, timeout_s: int = 5
    ) -> None:
        if extract not in ("any", "latex", "expr"):
            raise ValueError(f"extract must be 'any', 'latex' or 'expr', not {extract!r}")
        if not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1 (math-verify's timeouts are), not {timeout_s!r}")
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("the math reward needs the math-verify package: pip install 'asyncrl[data]'")
        self.extract, self.boxed_first, self.anchored, self.timeout_s = extract, boxed_first, anchored, timeout_s
        self._worker = _MathWorker()

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        gold = str(_reference(task))
        options = dict(extract=self.extract, boxed_first=self.boxed_first, anchored=self.anchored, timeout=self.timeout_s)
        request = dict(gold=gold, answer=completion_text, **options)
        verdict = await self._worker.check(request, 3 * self.timeout_s + 5)
        if verdict.pop("gold_unparsed", False):
            raise RewardError(f"math-verify cannot parse the reference answer {gold[:200]!r}")
        correct = bool(verdict.get("correct", False))
        return RewardResult(float(correct), {"correct": correct, "unparsed": bool(verdict.pop("unparsed", False)), **verdict})


# --- exact and regex ---------------------------------------------------------------------------

_SPACES = re.compile(r"\s+")
_NUMBER = re.compile(r"[-+]?(?=[.\d])(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?(?:[eE][-+]?\d+)?")


def normalize(text: str) -> str:
    """Stripped, whitespace runs made one space, case-folded."""
    return _SPACES.sub(" ", text.strip()).casefold()


def canonical_number(text: str) -> str:
    """A text that is one number, written canonically ("1,000.50", "+1000.5" and "1.0005e3" all
    become "1000.5"); any other text unchanged."""
    stripped = text.strip()
    if not _NUMBER.fullmatch(stripped):
        return text
    try:
        value = Decimal(stripped.replace(",", "")).normalize()
    except InvalidOperation:
        return text
    if value.is_zero():
        return "0"
    # Positional notation, except for exponents that would spell out hundreds of digits.
    return format(value, "f") if abs(value.adjusted()) <= 100 else str(value)


def _references(task: Any) -> list[str]:
    """The accepted answers: `task.answer`, or each of them when it is a list."""
    answer = _reference(task)
    return [str(a) for a in answer] if isinstance(answer, (list, tuple)) else [str(answer)]


class ExactReward:
    """1 when the answer equals `task.answer` (or one of a list of answers), else 0.

    Options: `normalize` (compare after stripping, collapsing whitespace and case-folding; False:
    character for character), `numbers` (also write a number canonically: 1,000 = 1000.0 = +1000)."""

    def __init__(self, *, normalize: bool = True, numbers: bool = False) -> None:
        self.normalize, self.numbers = normalize, numbers

    def canonical(self, text: str) -> str:
        """What is compared: the text as configured (normalized, numbers canonical)."""
        if self.normalize:
            text = normalize(text)
        return canonical_number(text) if self.numbers else text

    def matches(self, text: str, task: Any) -> bool:
        got = self.canonical(text)
        return any(got == self.canonical(reference) for reference in _references(task))

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        correct = self.matches(completion_text, task)
        return RewardResult(float(correct), {"correct": correct, "unparsed": False})


class RegexReward:
    """A regular expression over the answer, in one of two modes.

    `mode: match`: 1 when `pattern` is found in the answer (`fullmatch`: the whole stripped answer
    must match); with no `pattern` option the task's answer is the pattern. `mode: extract`: the
    pattern's group `answer` (else its first group, else the whole match) is taken from the `last`
    (or first) match and compared to `task.answer` as `ExactReward` compares (`normalize`,
    `numbers`); no match is an unparsed answer. `ignore_case` applies to the pattern."""

    def __init__(
        self,
        *,
        pattern: str | None = None,
        mode: Literal["match", "extract"] = "match",
        fullmatch: bool = False,
        ignore_case: bool = False,
        which: Literal["first", "last"] = "last",
        normalize: bool = True,
        numbers: bool = False,
    ) -> None:
        if mode not in ("match", "extract"):
            raise ValueError(f"mode must be 'match' or 'extract', not {mode!r}")
        if which not in ("first", "last"):
            raise ValueError(f"which must be 'first' or 'last', not {which!r}")
        if mode == "extract" and pattern is None:
            raise ValueError("mode 'extract' needs a pattern (the reference answer is what it is compared to)")
        self.flags = re.IGNORECASE if ignore_case else 0
        self.pattern = None if pattern is None else self._compile(pattern, ValueError)
        self.mode, self.fullmatch, self.which = mode, fullmatch, which
        self.exact = ExactReward(normalize=normalize, numbers=numbers)

    def _compile(self, pattern: str, error: type[Exception]) -> re.Pattern:
        try:
            return re.compile(pattern, self.flags)
        except re.error as e:
            raise error(f"invalid regular expression {pattern!r}: {e}") from e

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        if self.mode == "match":
            pattern = self.pattern or self._compile(str(_reference(task)), RewardError)
            found = pattern.fullmatch(completion_text.strip()) if self.fullmatch else pattern.search(completion_text)
            return RewardResult(float(found is not None), {"correct": found is not None, "unparsed": False})
        assert self.pattern is not None
        matches = list(self.pattern.finditer(completion_text))
        if not matches:
            return RewardResult(0.0, {"correct": False, "unparsed": True})
        match = matches[-1] if self.which == "last" else matches[0]
        groups = match.groupdict()
        extracted = groups["answer"] if "answer" in groups else match.group(1) if self.pattern.groups else match.group(0)
        correct = extracted is not None and self.exact.matches(extracted, task)
        return RewardResult(float(correct), {"correct": correct, "unparsed": extracted is None, "extracted": (extracted or "")[:200]})
