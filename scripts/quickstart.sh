#!/usr/bin/env bash
# One command on a fresh machine: create the environment, install, then the main job on CPU:
# SFT warm start, then asynchronous Reasoning RL (`asyncrl run quickstart`; summary in
# runs/quickstart/summary.json). Extra arguments are config overrides, e.g. `loop.steps=50`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
asyncrl run quickstart "$@"
