#!/usr/bin/env bash
# Static checks, fast, before the tests: ruff (lint and format), the import contract of the three
# floors (import-linter) and the type checker (mypy) over the source folders.
#
# The component folders sit at the repository root but are the package asyncrl.<folder>
# (package-dir in pyproject.toml). import-linter and mypy find a package by walking its one
# directory, so both read a staged copy of the package in its installed shape; paths in their
# messages are mapped back to the repository's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ruff check .
ruff format --check .

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -r asyncrl "$STAGE/asyncrl"
for folder in configs rollout gateway envs learner distill sched; do
    cp -r "$folder" "$STAGE/asyncrl/$folder"
done
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
unmap() { sed -E "s#$STAGE/asyncrl/(configs|rollout|gateway|envs|learner|distill|sched)/#\1/#g; s#$STAGE/##g"; }

(cd "$STAGE" && PYTHONPATH="$STAGE" lint-imports --config "$ROOT/pyproject.toml" --no-cache) 2>&1 | unmap
status=${PIPESTATUS[0]}
(cd "$STAGE" && MYPYPATH="$STAGE" mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" -p asyncrl) 2>&1 | unmap
status=$(( status | PIPESTATUS[0] ))
exit "$status"
