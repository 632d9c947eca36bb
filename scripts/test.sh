#!/usr/bin/env bash
# One command on a fresh machine: create the environment, install, start what the tests need,
# run the test suite. Extra arguments go to pytest (e.g. `scripts/test.sh -m "not slow"`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/services.sh"
cd "$ROOT"

ensure_redis

set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests" >&2
    exit 1
fi
exit "$status"
