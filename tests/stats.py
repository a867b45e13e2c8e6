"""A deterministic goodness-of-fit check for the sampling tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats

P_VALUE_FLOOR = 1e-4  # seeded tests: the statistic is fixed, so this is a threshold, not a gamble


def fit_p_value(samples: list[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of observed outcomes against exact probabilities.

    Outcomes whose expected count is below 5 are pooled into one cell, as the test requires.
    An observed outcome with probability zero gives p = 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(probs.get(k, 0.0) == 0.0 for k in counts):
        return 0.0
    big = [k for k, p in probs.items() if p * n >= 5]
    small = [k for k, p in probs.items() if 0 < p * n < 5]
    observed = [counts[k] for k in big]
    expected = [probs[k] * n for k in big]
    if sum(probs[k] for k in small) * n >= 5:
        observed.append(sum(counts[k] for k in small))
        expected.append(sum(probs[k] for k in small) * n)
    else:  # too rare to test as a cell: fold into the least likely testable cell
        observed[-1] += sum(counts[k] for k in small)
        expected[-1] += sum(probs[k] for k in small) * n
    expected_arr = np.asarray(expected)
    expected_arr *= n / expected_arr.sum()
    return float(stats.chisquare(observed, expected_arr).pvalue)
