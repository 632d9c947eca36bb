#!/usr/bin/env bash
# The chaos suite's long variant: `scripts/chaos.sh [ROUNDS]` (default 10) runs tests/chaos/ ROUNDS
# times, each round a fresh kill -9 of every part at a new moment, keeps each round's figures under
# runs/chaos/rounds/N/ and writes the spread of every recovery time (min, median, max over the rounds)
# to runs/chaos/summary.json. It stops at the first round that fails. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/services.sh"
cd "$ROOT"

rounds="${1:-10}"
shift || true
ensure_redis
ensure_bubblewrap || true
ensure_docker || true

rm -rf runs/chaos/rounds
for round in $(seq 1 "$rounds"); do
    echo "[chaos] round $round of $rounds" >&2
    python -m pytest -m chaos tests/chaos -q -p no:cacheprovider "$@"
    mkdir -p "runs/chaos/rounds/$round"
    cp runs/chaos/*.json "runs/chaos/rounds/$round/"
done

python - <<'EOF'
import json, statistics
from pathlib import Path

rounds = sorted(Path("runs/chaos/rounds").iterdir(), key=lambda p: int(p.name))
spread: dict[str, dict[str, list[float]]] = {}
for directory in rounds:
    for path in directory.glob("*.json"):
        figures = json.loads(path.read_text())
        for key, value in figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith("_s"):
                spread.setdefault(path.stem, {}).setdefault(key, []).append(value)
summary = {
    test: {key: {"min": min(v), "median": statistics.median(v), "max": max(v), "rounds": len(v)} for key, v in keys.items()}
    for test, keys in sorted(spread.items())
}
Path("runs/chaos/summary.json").write_text(json.dumps(summary, indent=1))
for test, keys in summary.items():
    for key, s in keys.items():
        print(f"{test:24s} {key:40s} min {s['min']:8.2f}  median {s['median']:8.2f}  max {s['max']:8.2f}  ({s['rounds']} rounds)")
print("runs/chaos/summary.json")
EOF
