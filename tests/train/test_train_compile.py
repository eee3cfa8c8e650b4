"""`run.shapes.TrainCompile`: a run's train-step programs compiling on a thread of their
own while the run goes on (its SFT warm-up), with fake steps whose compiles the test
holds and releases. The real programs are checked by the precompiled smoke run
(tests/train/test_schedule_resume.py: nothing compiles after the warm-up)."""

import threading

import pytest

from mtrl_jax.run.shapes import ShapePlan, TrainCompile

# Two row buckets x one length x three logit buckets: 6 programs.
_PLAN = ShapePlan(
    engine=None, samplings=(), fanout=1, train_rows=(8, 16), train_lens=(32,), packing="tree"
)


class _Step:
  """A train step whose programs record where they were lowered and compiled; each
  compile waits for `release` (set: compiles at once)."""

  def __init__(self, fail_at=None):
    self.lowered, self.compiled, self.threads = [], [], set()
    self.release, self.fail_at = threading.Event(), fail_at
    self.started = threading.Event()  # the first compile began

  def lower(self, spec):
    shape = spec.tokens_BxL.shape + (spec.old_logp_BxK.shape[1],)
    if shape == self.fail_at:
      raise ValueError(f"cannot lower {shape}")
    self.lowered.append(shape)
    self.threads.add(threading.current_thread().name)
    return [_Lowered(self, shape)]


class _Lowered:

  def __init__(self, step, shape):
    self.step, self.shape = step, shape

  def compile(self):
    self.step.started.set()
    assert self.step.release.wait(30), "the test never released the compile"
    self.step.compiled.append(self.shape)


def test_programs_compile_on_their_own_thread_while_the_caller_goes_on():
  step, seen = _Step(), []
  compiling = TrainCompile(_PLAN, [step], progress=lambda *a: seen.append(a))
  assert step.started.wait(30)  # compiling although the caller has not waited yet
  assert step.compiled == []  # held: the caller went on
  step.release.set()
  info = compiling.wait()
  expected = [(b, 32, k) for b in (8, 16) for k in (8, 16, 32)]
  assert sorted(step.compiled) == sorted(expected) and len(step.compiled) == 6
  assert step.threads == {"train-step-compile"}
  assert info["train_programs"] == 6 and info["train_seconds"] >= 0
  assert info["train_waited_seconds"] <= info["train_seconds"] + 0.1
  assert seen == [("train-step", n, 6) for n in range(7)]
  compiling.cancel()  # after wait: a no-op


def test_cancel_stops_after_the_program_compiling_now():
  step = _Step()
  compiling = TrainCompile(_PLAN, [step])
  assert step.started.wait(30)
  threading.Timer(1.0, step.release.set).start()  # then the compile in flight ends
  compiling.cancel()  # returns once it has
  assert len(step.compiled) == 1  # the one in flight; none started after the cancel


def test_an_error_on_the_thread_is_raised_by_wait():
  step = _Step(fail_at=(16, 32, 8))
  step.release.set()
  compiling = TrainCompile(_PLAN, [step])
  with pytest.raises(ValueError, match=r"cannot lower \(16, 32, 8\)"):
    compiling.wait()
