#!/usr/bin/env bash
# The GPU checks in one command: the tests marked `gpu` (tests/test_gpu.py), then scripts/gpu_smoke.py
# (the engine and the learner on the GPU against the CPU, their throughput, and, where Ray is
# installed, a short `asyncrl run` on the GPU). Results: $OUT/gpu_smoke.json (OUT defaults to
# runs/gpu-smoke) and one printed line per figure. docs/HARDWARE.md says how to read them.
#
#   bash scripts/gpu_smoke.sh                 a GPU machine with the network: sets up .venv as the
#                                             README does (a CUDA torch where nvidia-smi works), then runs
#   bash scripts/gpu_smoke.sh --fetch-wheels  here, before a run on a machine without the network whose
#                                             python has torch (the lent device machine): downloads what
#                                             asyncrl needs and it lacks into .whl/ (git-ignored)
#   bash scripts/gpu_smoke.sh --offline       there, with .whl/ carried: installs from it, then runs
#
#   ASYNCRL_SMOKE_ARGS   more arguments for gpu_smoke.py (e.g. "--size 2048 --run-seconds 0")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/runs/gpu-smoke}"
# What asyncrl imports that the lent machine lacks or has too old (its transformers, 5.17, predates some of
# what asyncrl uses), with what those need in turn.
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions transformers huggingface-hub
    httpx2 httpcore2 truststore hf-xet kernels tomlkit click regex tokenizers safetensors)

case "${1:-}" in
--fetch-wheels)
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || { echo "[gpu-smoke] run scripts/setup_env.sh first: the wheels are pinned to .venv's versions" >&2; exit 2; }
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
    mkdir -p .whl
    pinned=()
    for name in "${WHEELS[@]}"; do pinned+=("$name==$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")"); done
    # The device machine's python is 3.12 on x86-64; these are pure Python but pydantic-core.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pinned[@]}"
    du -sh .whl
    exit 0
    ;;
--offline)
    SITE=/tmp/asyncrl-site
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$ROOT"
    PYTHON=python3
    ;;
"")
    source "$ROOT/scripts/setup_env.sh"
    PYTHON=python
    ;;
*)
    echo "usage: scripts/gpu_smoke.sh [--fetch-wheels | --offline]" >&2
    exit 2
    ;;
esac

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "[gpu-smoke] no NVIDIA GPU here" >&2; exit 2; }
mkdir -p "$OUT"
set +e
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
# shellcheck disable=SC2086  # ASYNCRL_SMOKE_ARGS is a list of arguments
PYTHONUNBUFFERED=1 "$PYTHON" scripts/gpu_smoke.py --out "$OUT" ${ASYNCRL_SMOKE_ARGS:-} 2>&1 | tee "$OUT/smoke.log"
smoke=${PIPESTATUS[0]}
set -e
echo "[gpu-smoke] tests exit $tests, checks exit $smoke; results in $OUT/gpu_smoke.json"
[ "$tests" -eq 0 ] && [ "$smoke" -eq 0 ]
