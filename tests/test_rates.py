"""benchmarks/rates.py's confidence bound (the one benchmarks/crash_loop.py prints) against
scipy's beta quantile (the exact Clopper-Pearson bound) and the closed form for no failures."""

import pytest
from scipy import stats

from benchmarks.rates import upper_bound


@pytest.mark.parametrize("crashes,runs", [(0, 1), (0, 30), (0, 49), (1, 9), (3, 40), (7, 8)])
def test_upper_bound_is_clopper_pearsons(crashes, runs):
  want = stats.beta.ppf(0.95, crashes + 1, runs - crashes)
  assert upper_bound(crashes, runs) == pytest.approx(want, abs=1e-9)
  if crashes == 0:
    assert upper_bound(0, runs) == pytest.approx(1 - 0.05 ** (1 / runs), abs=1e-12)
  assert upper_bound(runs, runs) == 1.0
