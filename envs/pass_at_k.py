"""pass@k from n samples per problem, and its confidence interval.

pass@k is the chance that at least one of k samples solves a problem. With n >= k samples of which c
succeed, the unbiased estimate is 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code"), averaged over problems; drawing k samples and checking them would waste the
other n - k. The interval is a percentile bootstrap over problems (the unit drawn from the task's
distribution), seeded so the same results give the same interval.
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """One problem's unbiased pass@k from `c` successes in `n` samples (k <= n)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k)/C(n, k) as a product, exact in floating point where the binomials overflow.
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def per_problem(successes: list[int], n: int, k: int) -> np.ndarray:
    return np.array([pass_at_k(n, c, k) for c in successes])


def mean_and_interval(values: np.ndarray, *, seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the mean over problems and its percentile-bootstrap interval."""
    if len(values) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))].mean(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(values.mean()), float(low), float(high)
