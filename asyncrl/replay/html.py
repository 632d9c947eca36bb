"""`asyncrl replay score --html`: the scores as one self-contained HTML page.

The page opens from disk with no server and no network: its CSS and script are inline
(`report_template`) and the scores travel inside it as JSON, which the script turns into the
rollouts' headers, turn tables and coloured tokens. Token text is whatever the policy wrote or an
environment returned, so the JSON is escaped to never close its script element (`embed_json`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from asyncrl.configs.schema import LearnerConfig

from .records import RolloutScore
from .report_template import page
from .rescore import glm5_bounds


def objective_bands(learner: LearnerConfig) -> dict[str, tuple[float, float]]:
    """Per objective, the ratio band outside which it masks a token: where the report's colours saturate."""
    eps_low, eps_high, beta = glm5_bounds(learner)
    return {"double_sided_is": (1.0 - eps_low, 1.0 + eps_high), "icepop_grpo": (1.0 / beta, beta)}


def shown_objective(learner: LearnerConfig) -> str | None:
    """The objective whose decisions the report opens on: the run's where it is one the report shows."""
    return learner.objective.name if learner.objective.name in ("double_sided_is", "icepop_grpo") else None


def write_report(
    scores: list[RolloutScore],
    path: Path,
    *,
    title: str,
    bands: dict[str, tuple[float, float]] | None = None,
    objective: str | None = None,
) -> Path:
    """Write the report of `scores` to `path` (its folder is created) and return the path.

    `bands`: the run's ratio bands (`objective_bands(run.learner)`); the schema defaults otherwise.
    `objective`: the one whose decisions the page shows first (the run's own); the first found otherwise.
    """
    payload = {
        "title": title,
        "bands": bands if bands is not None else objective_bands(LearnerConfig()),
        "objective": objective,
        "rollouts": [score.to_dict() for score in scores],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(title, embed_json(payload)), encoding="utf-8")
    return path


def embed_json(value: Any) -> str:
    """JSON that is safe as the text of a <script> element and that JSON.parse accepts.

    `<`, `>` and `&` are written as \\u escapes, so no token text can spell `</script>` or `<!--`;
    non-finite floats (a ratio that overflowed) become the strings "Infinity", "-Infinity" and "NaN",
    which the page's script reads back as numbers.
    """
    text = json.dumps(_finite(value), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
