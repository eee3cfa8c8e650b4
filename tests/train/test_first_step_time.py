"""`time/first_step`: seconds from the start of `rl.train` to the end of the first RL
update, in the first step's metrics row and in summary.json (run-bound: resumed-run
comparisons leave it out)."""

from mtrl_jax.metrics import RUN_BOUND_PREFIXES


def test_the_first_steps_row_and_the_summary_hold_time_to_the_first_step(smoke_run):
  rows, summary = smoke_run.rows(), smoke_run.summary()
  first = rows[1]
  assert first["step"] == 1
  # At least the first update itself, at most the whole run's time in its steps.
  assert first["time/train"] <= first["time/first_step"] < 900
  assert [r["step"] for r in rows if "time/first_step" in r] == [1]
  assert summary["time/first_step"] == first["time/first_step"]
  assert "time/first_step".startswith(RUN_BOUND_PREFIXES)
