#!/usr/bin/env bash
# The whole post-training pipeline on a fresh machine: create the environment, install, install
# bubblewrap for the agentic stage's sandbox where it is missing, then `asyncrl pipeline pipeline`
# (SFT -> Reasoning RL -> Agentic RL -> General RL -> distillation, ~25 minutes on 2 idle cores;
# runs/pipeline/summary.json and matrix.png). Extra arguments are pipeline overrides, e.g.
# `stages.agentic=null`; a stopped pipeline continues with `asyncrl pipeline --resume runs/pipeline`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/services.sh"
ensure_bubblewrap
cd "$ROOT"
asyncrl pipeline pipeline "$@"
