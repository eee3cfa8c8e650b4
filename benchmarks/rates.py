"""Confidence bounds for rates seen in repeated runs (`benchmarks/crash_loop.py`).

A module of its own, without flags: tests import it beside other benchmarks.
"""


def upper_bound(crashes: int, runs: int, confidence: float = 0.95) -> float:
  """The exact (Clopper-Pearson) one-sided upper bound of a rate seen `crashes` times in
  `runs`, by bisection on the binomial tail."""
  if crashes >= runs:
    return 1.0

  def tail(p):  # P(X <= crashes) for X ~ Binomial(runs, p)
    term, total = (1 - p) ** runs, 0.0
    for k in range(crashes + 1):
      total += term
      term *= (runs - k) / (k + 1) * p / (1 - p) if p < 1 else 0.0
    return total

  lo, hi = crashes / runs, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if tail(mid) > 1 - confidence else (lo, mid)
  return hi
