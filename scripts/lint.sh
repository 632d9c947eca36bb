#!/usr/bin/env bash
# Static checks, fast, before the tests: ruff (lint and format), the import contract of the three
# floors (import-linter) and the type checker (mypy) over the source folders.
#
# Every check runs, whatever an earlier one found, so one run shows all that is wrong; each prints
# its verdict, a summary line names the failed ones and the exit status is non-zero if any failed.
#
# The component folders sit at the repository root but are the package asyncrl.<folder>
# (package-dir in pyproject.toml). import-linter and mypy find a package by walking its one
# directory, so both read a staged copy of the package in its installed shape; paths in their
# messages are mapped back to the repository's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -r asyncrl "$STAGE/asyncrl"
for folder in configs rollout gateway envs learner distill sched; do
    cp -r "$folder" "$STAGE/asyncrl/$folder"
done
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
unmap() { sed -E "s#$STAGE/asyncrl/(configs|rollout|gateway|envs|learner|distill|sched)/#\1/#g; s#$STAGE/##g"; }

ruff_check() { ruff check .; }
ruff_format() { ruff format --check .; }
import_contract() { (cd "$STAGE" && PYTHONPATH="$STAGE" lint-imports --config "$ROOT/pyproject.toml" --no-cache) 2>&1 | unmap; }
types() { (cd "$STAGE" && MYPYPATH="$STAGE" mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" -p asyncrl) 2>&1 | unmap; }

failed=()
checks_run=0
# A check's own failure must not end the script (set -e), so each runs as an `if` condition, where
# errexit is off; pipefail still gives a pipeline the status of the checker, not of unmap.
run_check() {
    local name="$1"
    echo "[lint] $name ..."
    checks_run=$((checks_run + 1))
    if "$2"; then
        echo "[lint] $name: passed"
    else
        echo "[lint] $name: FAILED"
        failed+=("$name")
    fi
}
run_check "ruff check" ruff_check
run_check "ruff format --check" ruff_format
run_check "import-linter" import_contract
run_check "mypy" types

if [ "${#failed[@]}" -gt 0 ]; then
    summary="$(printf '%s, ' "${failed[@]}")"
    echo "[lint] FAILED: ${summary%, } (${#failed[@]} of $checks_run checks)" >&2
    exit 1
fi
echo "[lint] all $checks_run checks passed"
