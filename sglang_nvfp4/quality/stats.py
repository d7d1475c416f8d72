"""Confidence intervals for accuracies measured on a few hundred prompts."""

from __future__ import annotations

import math


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval ``(lo, hi)`` of the proportion ``hits / n`` (``z = 1.96``: 95%); ``(0, 1)``
    when ``n == 0``. Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n hits."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre, half = p + z * z / (2 * n), z * math.sqrt((p * (1 - p) + z * z / (4 * n)) / n)
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def paired_difference_interval(correct, baseline_correct, z: float = 1.96) -> tuple[float, float, float]:
    """Accuracy difference ``(d, lo, hi)`` of ``correct`` minus ``baseline_correct`` (booleans over the
    same prompts, in the same order), with a Wald interval on the paired differences: with ``b`` the
    prompts only ``correct`` gets right and ``c`` those only the baseline gets right, ``d = (b - c) / n``
    and ``se = sqrt(b + c - (b - c)^2 / n) / n``. Fractions, not points; ``(0, 0, 0)`` for no prompts, and
    a zero-width interval when no prompt is discordant."""
    pairs = list(zip(correct, baseline_correct, strict=True))
    n = len(pairs)
    if n == 0:
        return 0.0, 0.0, 0.0
    b = sum(bool(x) and not bool(y) for x, y in pairs)
    c = sum(bool(y) and not bool(x) for x, y in pairs)
    d = (b - c) / n
    se = math.sqrt(max(0.0, b + c - (b - c) ** 2 / n)) / n
    return d, d - z * se, d + z * se
