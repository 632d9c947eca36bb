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
#   bash scripts/gpu_smoke.sh --offline       there, with .whl/ carried: installs from it, then runs; after
#                                             --stage-run-wheels (below), the `asyncrl run` checks too
#
# The lent machine takes 64 MiB of carried files a call, so the Ray run's wheels (.whl-run/, Ray without
# its Java jars and libraries asyncrl does not use) go in a call of their own just before, while the
# machine is still warm: carry [".whl-run"] with `bash scripts/gpu_smoke.sh --stage-run-wheels`, then
# carry [".whl"] with `bash scripts/gpu_smoke.sh --offline`.
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
# What `asyncrl run` adds (Ray core, the gateway, the episodes' OpenAI client), where the machine's copy is
# missing or may be older than asyncrl's floor.
RUN_WHEELS=(ray jsonschema jsonschema-specifications referencing rpds-py fastapi starlette annotated-doc opentelemetry-api
    uvicorn httptools h11 redis openai jiter sniffio anyio aiohttp multidict yarl propcache aiohappyeyeballs aiosignal
    frozenlist attrs msgpack)
SITE=/tmp/asyncrl-site

case "${1:-}" in
--fetch-wheels)
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || { echo "[gpu-smoke] run scripts/setup_env.sh first: the wheels are pinned to .venv's versions" >&2; exit 2; }
    for folder in .whl .whl-run; do
        grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >>.git/info/exclude
        rm -rf "$folder" && mkdir -p "$folder"
    done
    download() {  # folder, names: the versions .venv holds, for the device machine's python (3.12, x86-64)
        local folder=$1 pinned=() name
        shift
        for name in "$@"; do pinned+=("$name==$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")"); done
        if ! log=$(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$folder" "${pinned[@]}" 2>&1); then
            grep -v "^WARNING: Location" <<<"$log" >&2
            echo "[gpu-smoke] could not download the wheels for $folder/" >&2
            exit 1
        fi
    }
    download .whl "${WHEELS[@]}"
    download .whl-run "${RUN_WHEELS[@]}"
    # Ray's wheel is 79 MB; without the Java jars and the libraries asyncrl never imports it fits a call.
    "$PY" - .whl-run/ray-*.whl <<'STRIP'
import sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
unused = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/", "ray/train/", "ray/llm/", "ray/dashboard/client/build/")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
    for item in source.infolist():
        if not item.filename.startswith(unused):
            target.writestr(item, source.read(item))
slim.replace(wheel)
STRIP
    du -sh .whl .whl-run
    exit 0
    ;;
--stage-run-wheels)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl-run/*.whl
    echo "[gpu-smoke] staged $(ls .whl-run | wc -l) wheels for the asyncrl run checks in $SITE"
    exit 0
    ;;
--offline)
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
    echo "usage: scripts/gpu_smoke.sh [--fetch-wheels | --stage-run-wheels | --offline]" >&2
    exit 2
    ;;
esac

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "[gpu-smoke] no NVIDIA GPU here" >&2; exit 2; }
mkdir -p "$OUT"
set +e
# Outside the repository, and -P: its root holds an asyncrl/ folder that would shadow the package installed
# with --offline, in this process and in the Ray workers (Ray puts the driver's directory on their path).
cd "$(mktemp -d)"
"$PYTHON" -P -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -m gpu "$ROOT/tests/test_gpu.py" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
# shellcheck disable=SC2086  # ASYNCRL_SMOKE_ARGS is a list of arguments
PYTHONUNBUFFERED=1 "$PYTHON" -P "$ROOT/scripts/gpu_smoke.py" --out "$OUT" ${ASYNCRL_SMOKE_ARGS:-} 2>&1 | tee "$OUT/smoke.log"
smoke=${PIPESTATUS[0]}
set -e
echo "[gpu-smoke] tests exit $tests, checks exit $smoke; results in $OUT/gpu_smoke.json"
[ "$tests" -eq 0 ] && [ "$smoke" -eq 0 ]
