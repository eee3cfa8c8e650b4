"""Task streams: the curriculum moves levels by rolling success and resumes exactly."""

import json

import pytest

from mtrl_jax import data
from mtrl_jax.data import CurriculumConfig, CurriculumStream, ListSource


def _source(level):
  return ListSource([{"level": level, "i": i} for i in range(7)])


def _stream(**kw):
  cfg = CurriculumConfig(
      enabled=True, **{"num_levels": 3, "window": 3, "raise_above": 0.7, "lower_below": 0.3, **kw}
  )
  return CurriculumStream(_source, cfg, seed=5)


def test_level_moves_on_a_full_window_above_or_below_the_thresholds():
  s = _stream()
  trace = []
  # Three steps above 0.7 -> up; the window empties, so two more highs do not move it;
  # a third does; at the top it stays; then lows bring it down one window at a time.
  for success in (0.8, 0.9, 1.0, 0.8, 0.8, 0.8, 1.0, 1.0, 1.0, 0.2, 0.1, 0.0, 0.5, 0.5, 0.5):
    tasks = s.next(2)
    assert {t["level"] for t in tasks} == {t["curriculum_level"] for t in tasks} == {s.level}
    m = s.observe(success)
    assert m["curriculum/level"] == tasks[0]["level"]
    trace.append(s.level)
  assert trace == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1]
  # The last window (0.5, 0.5, 0.5) stayed; the rolling mean keeps the latest k = 3.
  assert s.observe(0.25)["curriculum/rolling_success"] == pytest.approx((0.5 + 0.5 + 0.25) / 3)
  fresh = _stream()
  assert fresh.observe(0.4)["curriculum/rolling_success"] == pytest.approx(0.4)  # window so far


def test_between_the_thresholds_or_at_the_ends_the_level_stays():
  s = _stream(start_level=0)
  for _ in range(6):
    s.next(1)
    s.observe(0.0)  # below lower_below at level 0: nowhere to go
  assert s.level == 0
  for _ in range(6):
    s.observe(0.5)  # between the thresholds
  assert s.level == 0
  for _ in range(3):
    s.observe(0.7)  # not strictly above raise_above
  assert s.level == 0


def test_each_level_walks_its_own_seeded_order():
  s = _stream()
  first = [t["i"] for t in s.next(7)]
  assert sorted(first) == list(range(7))
  assert first == [t["i"] for t in data.TaskStream(_source(0), seed=5).next(7)]


def test_resumed_stream_draws_the_same_tasks_and_levels():
  successes = [1.0, 1.0, 0.9, 0.2, 0.8, 1.0, 1.0, 0.0, 0.1, 0.0, 0.6, 0.9]
  a = _stream()
  for x in successes[:5]:
    a.next(3)
    a.observe(x)
  saved = json.loads(json.dumps(a.state()))  # what the checkpoint meta holds
  b = _stream()
  b.restore(saved)
  for x in successes[5:]:
    assert a.next(3) == b.next(3)
    assert a.observe(x) == b.observe(x)
  assert a.state() == b.state()
  with pytest.raises(ValueError, match="num_levels"):
    _stream(num_levels=4).restore(saved)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(window=0), "curriculum.window=0"),
        (dict(num_levels=1), "curriculum.num_levels=1"),
        (dict(start_level=5), "curriculum.start_level=5"),
        (dict(lower_below=0.9, raise_above=0.8), "curriculum.lower_below=0.9"),
        (dict(raise_above=1.5), "raise_above=1.5"),
        (dict(level_key="not a name"), "curriculum.level_key"),
    ],
)
def test_bad_curriculum_configs_fail_in_one_line(kw, field):
  with pytest.raises(ValueError) as err:
    CurriculumConfig(**kw)
  assert field in str(err.value) and "allowed" in str(err.value) and "\n" not in str(err.value)


def _stale_loop(stream, successes, start=0, checkpoints=None):
  """The RL loop's use of a stream under rl.max_staleness=1: step k + 1 is drawn (after a
  mark) before step k is observed; the checkpoint after step k undoes that draw.
  Returns (tasks, observe metrics) per step; `checkpoints` collects step -> state."""
  drawn = {start + 1: stream.next(2)}
  out = []
  for step in range(start + 1, len(successes) + 1):
    mark = stream.state()
    if step < len(successes):
      drawn[step + 1] = stream.next(2)
    m = stream.observe(successes[step - 1])
    out.append((drawn[step], m))
    if checkpoints is not None:
      in_flight = step < len(successes)
      checkpoints[step] = json.loads(
          json.dumps(stream.rewound(mark) if in_flight else stream.state())
      )
  return out


def test_stale_draws_are_labelled_by_their_level_and_resume_from_any_checkpoint():
  successes = [1.0, 1.0, 0.9, 0.2, 0.1, 0.0, 1.0, 0.9, 0.0, 0.0, 0.6, 0.9]
  checkpoints = {}
  full = _stale_loop(_stream(window=2), successes, checkpoints=checkpoints)
  for tasks, m in full:  # each step's label is the level its tasks came from
    assert m["curriculum/level"] == tasks[0]["curriculum_level"] == tasks[0]["level"]
  levels = [m["curriculum/level"] for _, m in full]
  # Levels move one step after the decision (the next step was drawn already).
  assert levels == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
  for k in range(1, len(successes)):
    resumed = _stream(window=2)
    resumed.restore(checkpoints[k])
    assert _stale_loop(resumed, successes, start=k) == full[k:], k
  s = _stream()
  mark = s.state()
  s.next(1)
  s.observe(0.5)  # the draw since the mark was observed: it cannot be undone
  with pytest.raises(ValueError, match="1 draws since the mark, 0 not yet observed"):
    s.rewound(mark)
