#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install asyncrl into it.
# Sourced by quickstart.sh and test.sh; safe to run again (it only installs what is missing).
#
#   ASYNCRL_VENV         where the environment lives (default: .venv at the repository root)
#   ASYNCRL_PYTHON       interpreter used to create it (default: python3)
#   ASYNCRL_TORCH_INDEX  a pip index URL for torch (e.g. PyTorch's CPU wheel index on a machine
#                        without a GPU whose pip would otherwise pick a CUDA build)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASYNCRL_VENV:-$ROOT/.venv}"
PYTHON="${ASYNCRL_PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Some machines configure pip with package locations that may be missing; pip warns about each one.
quiet_pip() { "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

# torch first: with a CPU build already installed, the project's torch range is satisfied and
# nothing pulls gigabytes of CUDA wheels.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        echo "[setup] GPU found: installing the default (CUDA) torch build"
        quiet_pip install -q "torch>=2.4,<2.15"
    elif [ -n "${ASYNCRL_TORCH_INDEX:-}" ]; then
        echo "[setup] no GPU: installing CPU torch from $ASYNCRL_TORCH_INDEX"
        quiet_pip install -q torch==2.13.0 --index-url "$ASYNCRL_TORCH_INDEX"
    else
        echo "[setup] no GPU: installing torch 2.13.0 (CPU build where the machine provides one)"
        quiet_pip install -q torch==2.13.0
    fi
fi

# Reinstall only when pyproject.toml changed since the last install.
STAMP="$VENV/.asyncrl-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    echo "[setup] installing asyncrl and its dependencies"
    quiet_pip install -q -e "$ROOT[dev]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
