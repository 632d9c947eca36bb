#!/usr/bin/env bash
# One command on a fresh machine: create the environment, install, run the main job on CPU.
# Extra arguments are config overrides, e.g. `scripts/quickstart.sh sft.time_budget_s=120`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
asyncrl sft quickstart "$@"
