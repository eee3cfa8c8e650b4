"""Fail loudly: start-up checks refuse before compute, and a run that learns nothing says so.

Start-up (`run/checks.py`, in-process on `experiment.validate`): a prompt that
does not fit `env.max_tokens`, an environment that cannot fork, micro-batches
that do not divide a planned batch, a task source of non-mappings and a success
threshold no outcome can pass are each refused in one line naming the field.
The loop (`run/watch.py`): a step that trains nothing warns with its reason,
idle streaks and masked windows halt, and the entry point exits with status 3
with the reason in summary.json and every file of the run kept.
"""

import json
import os
import re
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from configs import calculator as calc_config
from configs import coop as coop_config
from mtrl_jax import testing
from mtrl_jax.envs import Environment, EnvironmentFactory, SharedResource
from mtrl_jax.envs.faults import Fault, FaultKind
from mtrl_jax.rollout.records import ActionRecord, StepRecord
from mtrl_jax.run import experiment
from mtrl_jax.run.config import RLConfig
from mtrl_jax.run import watch as watch_lib
from mtrl_jax.run.watch import LearningWatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
  c = calc_config.get_config("smoke=True")
  for key, value in overrides.items():
    group, field = key.split(".")
    setattr(c[group], field, value)
  return c


def _refusal(c) -> str:
  with pytest.raises(experiment.ConfigError) as info:
    experiment.validate(c)
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("config "), msg
  return msg


# ------------------------------------------------------------------ start-up checks
def test_a_prompt_longer_than_the_token_budget_is_refused_with_its_length():
  # The calculator's tool schema in the system prompt: ~400 byte tokens.
  c = _config(
      **{"env.kwargs": {"show_tools": True}, "env.max_tokens": 256, "rl.length_buckets": (128, 512)}
  )
  msg = _refusal(c)
  assert msg.startswith("config env.max_tokens=256: the first task's prompt"), msg
  tokens = int(msg.split(" takes ")[1].split()[0])
  assert tokens > 256 and "sampling.max_new_tokens=24" in msg and "raise env.max_tokens" in msg
  c.env.max_tokens = tokens + 24 + 1
  c.rl.length_buckets = (128, 1024)
  assert experiment.validate(c).env.max_tokens == tokens + 25


def test_a_checkpoint_without_its_tokenizer_is_refused(tmp_path):
  from mtrl_jax.models.config import get_preset

  (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
  c = _config(**{"tokenizer.kind": "hf", "tokenizer.extra_specials": ""})
  c.model.path = str(tmp_path)
  msg = _refusal(c)
  assert msg.startswith(f"config tokenizer.kind='hf' with model.path='{tmp_path}'"), msg
  assert "no tokenizer.json" in msg, msg


class _LockedEnv(Environment):
  """Holds a lock as plain state: a deep copy (the default fork) fails."""

  def __init__(self, metadata, shared: bool):
    super().__init__({**metadata, "prompt": metadata["question"]})
    self.lock = _SharedLock() if shared else threading.Lock()

  def react_to(self, thread):
    return None, 1.0


class _SharedLock(SharedResource):

  def __init__(self):
    self.lock = threading.Lock()


class LockedFactory(EnvironmentFactory):

  def __init__(self, shared: bool = False):
    self.shared = shared

  def create_environment(self, metadata):
    return _LockedEnv(metadata, self.shared)


def test_an_environment_that_cannot_fork_is_refused_naming_fork_and_shared_resource():
  c = _config(**{"env.factory": f"{__name__}:LockedFactory"})
  msg = _refusal(c)
  assert f"env.factory='{__name__}:LockedFactory'" in msg and "fork()" in msg, msg
  assert "SharedResource" in msg and "lock" in msg, msg
  c.env.kwargs = {"shared": True}  # the lock held in a SharedResource: shared, not copied
  experiment.validate(c)


class _JudgedEnv(Environment):
  """Holds an LLM judge (a `LocalLLM`: it samples on the engine, shared across forks)."""

  def __init__(self, metadata):
    from mtrl_jax.sampling.generation import LocalLLM

    super().__init__({**metadata, "prompt": metadata["question"]})
    self.judge = object.__new__(LocalLLM)

  def react_to(self, thread):
    return None, 1.0


class JudgedFactory(EnvironmentFactory):

  def create_environment(self, metadata):
    return _JudgedEnv(metadata)


@pytest.mark.parametrize("factory", ["LockedFactory", "JudgedFactory"])
def test_worker_processes_refuse_an_environment_that_cannot_be_pickled(factory):
  # Forks (the lock and the judge are shared resources), but cannot cross to a process.
  kwargs = {"shared": True} if factory == "LockedFactory" else {}
  c = _config(**{"env.factory": f"{__name__}:{factory}", "env.kwargs": kwargs})
  experiment.validate(c)  # threads: shared in the engine's process
  c.env.workers = "processes"
  msg = _refusal(c)
  assert f"env.factory='{__name__}:{factory}'" in msg, msg
  assert "env.workers='processes'" in msg and "env.workers='threads'" in msg, msg
  want = "lock" if factory == "LockedFactory" else "LocalLLM samples on a model"
  assert want in msg, msg


@pytest.mark.several_devices
def test_microbatches_that_do_not_divide_a_planned_batch_are_refused():
  msg = _refusal(_config(**{"step.num_microbatches": 3}))
  assert msg.startswith("config step.num_microbatches=3 does not divide"), msg
  allowed = [int(x) for x in msg.split("allowed: one of [")[1].rstrip("]").split(",")]
  assert 1 in allowed and 3 not in allowed
  assert experiment.validate(_config(**{"step.num_microbatches": max(allowed)}))
  # The SFT warm-up's batches use the same step.
  msg = _refusal(_config(**{"step.num_microbatches": 2, "sft.batch_size": 9}))
  assert "sft.batch_size=9" in msg, msg


class _SelfForkingEnv(Environment):
  """Forks itself by hand, so only the thread's metadata (a lock in it) fails to copy."""

  def react_to(self, thread):
    return None, 1.0

  def fork(self):
    return self


class LockInMetadataFactory(EnvironmentFactory):

  def create_environment(self, metadata):
    return _SelfForkingEnv({**metadata, "prompt": metadata["question"], "lock": threading.Lock()})


def test_a_thread_whose_metadata_cannot_fork_is_refused():
  msg = _refusal(_config(**{"env.factory": f"{__name__}:LockInMetadataFactory"}))
  assert "Thread.fork failed (TypeError: cannot pickle" in msg and "SharedResource" in msg, msg


def strings_source(split, **kwargs):
  del kwargs
  return [f"{split} task {i}" for i in range(4)]


def test_a_task_source_of_non_mappings_is_refused():
  msg = _refusal(_config(**{"tasks.source": f"{__name__}:strings_source"}))
  assert f"tasks.source='{__name__}:strings_source'" in msg, msg
  assert "task 0 is a str, not a mapping" in msg, msg


def test_success_defaults_to_the_top_of_the_outcome_range():
  c = _config()
  c.eval.success_threshold = None
  exp = experiment.validate(c)
  assert 0.99 < exp.eval.success_threshold < 1.0  # calculator: outcome +1, range (-1, 1)
  c.reward.outcome_weight = 2.0  # outcomes are weighted as the reward composes them
  assert 1.99 < experiment.validate(c).eval.success_threshold < 2.0
  # Coop keeps its explicit threshold; a combined grader's style term alone (0.1) is
  # no success by default.
  assert experiment.validate(coop_config.get_config("smoke=True")).eval.success_threshold == 0.5
  c = _config(
      **{
          "env.factory": "weather",
          "tasks.source": "weather",
          "env.max_tokens": 600,
          "rl.length_buckets": (128, 1024),
          "tokenizer.extra_specials": "",
      }
  )
  c.eval.success_threshold = None
  c.sft.steps, c.sft.conversations = 0, ""
  assert experiment.validate(c).eval.success_threshold > 0.9


@pytest.mark.parametrize("threshold,word", [(1.0, "none"), (-1.5, "every one")])
def test_a_threshold_no_outcome_or_every_outcome_passes_is_refused(threshold, word):
  msg = _refusal(_config(**{"eval.success_threshold": threshold}))
  assert msg.startswith(f"config eval.success_threshold={threshold}"), msg
  assert f"so {word} would pass" in msg and "[-1, 1)" in msg, msg


def test_new_rl_fields_refuse_bad_values_in_one_line():
  for field, value, needle in (
      ("halt_if_idle_steps", -1, "an integer >= 0"),
      ("max_masked_fraction", 1.5, "[0, 1]"),
      ("masked_window", 0, "an integer >= 1"),
  ):
    msg = _refusal(_config(**{f"rl.{field}": value}))
    assert msg.startswith(f"config rl.{field}={value}") and needle in msg, msg


# ------------------------------------------------------------------ the watch
def _action(ended=True, truncated=False, valid=True, fault=None):
  faults = (fault,) if fault else ()
  return ActionRecord(
      (StepRecord(0.0, valid=valid, truncated=truncated, faults=faults, done=ended),)
  )


def _tree(actions):
  """A one-node stand-in of a finalized tree (what the watch reads)."""
  node = types.SimpleNamespace(
      recorded=True, actions=list(actions), valid_B=np.array([a.valid for a in actions])
  )
  return types.SimpleNamespace(nodes=[node])


TRAINED = {"batch/actions": 4.0, "batch/zero_variance_groups": 0.0}
DROPPED = {"batch/actions": 0.0, "batch/zero_variance_groups": 2.0}
INFRA = Fault(FaultKind.INFRASTRUCTURE, "environment", "sandbox\nunreachable")


def test_a_step_that_trains_nothing_warns_with_its_reason():
  watch = LearningWatch(RLConfig())
  assert watch.observe(1, _tree([_action()] * 4), TRAINED) == ("", "")
  warning, halt = watch.observe(2, _tree([_action()] * 4), DROPPED)
  assert (
      warning.startswith(
          "step 2 trained no sample: every group's advantages were 0 (2 "
          "groups dropped by rl.zero_variance_filter)"
      )
      and not halt
  )
  budget = Fault(FaultKind.TRUNCATION, "framework", "token budget reached (300 >= 256 tokens)")
  warning, _ = watch.observe(3, _tree([_action(truncated=True, fault=budget)] * 4), DROPPED)
  assert "every trajectory was truncated (4; first: token budget reached (300 >= 256" in warning
  assert "raise env.max_tokens" in warning
  warning, _ = watch.observe(
      4, _tree([_action(valid=False, fault=INFRA)] * 4), {"batch/actions": 0.0}
  )
  assert (
      "every sample was masked (4 joint actions; first fault: infrastructure from "
      "environment: sandbox unreachable)"
  ) in warning and "\n" not in warning
  # A control without updates never warns.
  control = LearningWatch(RLConfig(updates_per_step=0))
  assert control.observe(1, _tree([_action()]), DROPPED) == ("", "")
  assert control.final() == ""


def test_consecutive_idle_steps_halt_and_a_resumed_watch_goes_on_counting():
  rl = RLConfig(halt_if_idle_steps=3)
  watch = LearningWatch(rl)
  watch.observe(1, _tree([_action()] * 2), DROPPED)
  watch.observe(2, _tree([_action()] * 2), TRAINED)  # a trained step resets the streak
  watch.observe(3, _tree([_action()] * 2), DROPPED)
  resumed = LearningWatch(rl, json.loads(json.dumps(watch.state())))
  assert resumed.observe(4, _tree([_action()] * 2), DROPPED)[1] == ""
  _, halt = resumed.observe(5, _tree([_action()] * 2), DROPPED)
  assert halt.startswith(
      "rl.halt_if_idle_steps=3: no sample trained in 3 consecutive "
      "steps (3-5); last: every group's advantages were 0"
  ), halt
  assert resumed.final() == ""  # step 2 trained
  never = LearningWatch(RLConfig(halt_if_idle_steps=0))
  for step in range(1, 30):
    assert never.observe(step, _tree([_action()]), DROPPED)[1] == ""
  assert never.final().startswith("the run trained no sample in 29 RL steps; last: every")


def test_a_converged_policy_warns_once_and_is_not_halted_as_idle():
  # Every sample succeeded: the groups are all alike because nothing is left to learn,
  # not because something is wrong. 30 such steps under halt_if_idle_steps=3 never halt.
  watch = LearningWatch(RLConfig(halt_if_idle_steps=3))
  watch.observe(1, _tree([_action()] * 2), DROPPED, success=0.0)
  watch.observe(2, _tree([_action()] * 2), DROPPED, success=0.5)  # 2 failing idle steps
  warnings = [
      watch.observe(step, _tree([_action()] * 2), DROPPED, success=1.0) for step in range(3, 33)
  ]
  assert all(halt == "" for _, halt in warnings)
  assert warnings[0][0] == (
      "step 3 trained no sample: every sample succeeded, so every "
      "group's rewards were alike (nothing left to learn from these "
      "tasks); not counted by rl.halt_if_idle_steps"
  )
  assert [w for w, _ in warnings[1:] if w] == []  # once per run of such steps
  # A failing idle step starts a new streak (the solved steps reset it) and warns again.
  assert watch.observe(33, _tree([_action()] * 2), DROPPED, success=0.0)[0].startswith(
      "step 33 trained no sample: every group's advantages were 0"
  )
  resumed = LearningWatch(watch.rl, json.loads(json.dumps(watch.state())))
  assert resumed.observe(34, _tree([_action()] * 2), DROPPED, success=1.0)[0].startswith(
      "step 34 trained no sample: every sample succeeded"
  )
  # Every sample masked is never "succeeded", whatever the metric says.
  masked = [_action(valid=False, fault=INFRA)] * 2
  assert "every sample was masked" in resumed.observe(35, _tree(masked), DROPPED, success=1.0)[0]


def test_a_masked_window_above_the_limit_halts_with_the_first_fault():
  rl = RLConfig(max_masked_fraction=0.5, masked_window=3, halt_if_idle_steps=0)
  half = [_action(), _action(valid=False, fault=INFRA)]  # 50%: not above the limit
  most = [_action(), _action(valid=False, fault=INFRA), _action(valid=False, fault=INFRA)]
  watch = LearningWatch(rl)
  assert watch.observe(1, _tree(most), TRAINED)[1] == ""  # the window is not full yet
  assert watch.observe(2, _tree(half), TRAINED)[1] == ""
  _, halt = watch.observe(3, _tree(most), TRAINED)  # 5 of 8
  assert halt == (
      "rl.max_masked_fraction=0.5: 5 of 8 joint actions (62%) were masked in "
      "steps 1-3; first fault: infrastructure from environment: sandbox "
      "unreachable"
  ), halt
  watch = LearningWatch(rl)  # the run's last step judges a window not yet full
  assert watch.observe(1, _tree(most), TRAINED, last=True)[1].startswith(
      "rl.max_masked_fraction=0.5: 2 of 3"
  )
  off = LearningWatch(RLConfig(max_masked_fraction=1.0, masked_window=1))
  assert off.observe(1, _tree([_action(valid=False, fault=INFRA)]), TRAINED)[1] == ""


def _multi_turn_tree(actions, num_turns=2):
  """`_tree` with the tree config the stall warnings read (room for a second turn)."""
  tree = _tree(actions)
  tree.cfg = types.SimpleNamespace(num_turns=num_turns, branch_on="every_turn")
  return tree


NO_CALL = {
    "tools/valid_calls": 0.0,
    "tools/turns_with_call": 0.25,
    "tools/parse_failures_per_call": 1.0,
    "rollout/past_first_turn": 0.5,
}
CALLED = {**NO_CALL, "tools/valid_calls": 2.0}


def test_no_valid_tool_call_warns_after_the_threshold_and_survives_a_resume():
  k = watch_lib.STALL_STEPS
  assert k == 3
  watch = LearningWatch(RLConfig())
  tree = _multi_turn_tree([_action()] * 2)
  assert watch.observe(1, tree, TRAINED, metrics=NO_CALL) == ("", "")
  assert watch.observe(2, tree, TRAINED, metrics=CALLED) == ("", "")  # resets the count
  assert watch.observe(3, tree, TRAINED, metrics=NO_CALL) == ("", "")
  resumed = LearningWatch(watch.rl, json.loads(json.dumps(watch.state())))
  assert resumed.observe(4, tree, TRAINED, metrics=NO_CALL) == ("", "")  # 2: not yet
  warning, halt = resumed.observe(5, tree, TRAINED, metrics=NO_CALL)
  assert (
      warning.startswith(
          "no valid tool call in 3 consecutive steps (3-5) of an environment "
          "that offers tools: the policy makes no call, or only calls "
          "that fail "
          "(tools/turns_with_call 0.25, tools/parse_failures_per_call "
          "1.00)"
      )
      and not halt
      and "\n" not in warning
  )
  assert resumed.observe(6, tree, TRAINED, metrics=NO_CALL) == ("", "")  # once per streak
  # An environment without tools logs no tools/* keys: never counted.
  quiet = LearningWatch(RLConfig())
  for step in range(1, 10):
    assert quiet.observe(step, tree, TRAINED, metrics={"rollout/past_first_turn": 1.0}) == ("", "")


def test_no_episode_past_its_first_turn_warns_in_a_multi_turn_tree_only():
  watch = LearningWatch(RLConfig())
  tree = _multi_turn_tree([_action()] * 2)
  first = {"rollout/past_first_turn": 0.0}
  assert watch.observe(1, tree, TRAINED, metrics=first) == ("", "")
  resumed = LearningWatch(watch.rl, json.loads(json.dumps(watch.state())))
  assert resumed.observe(2, tree, TRAINED, metrics=first) == ("", "")
  warning, _ = resumed.observe(3, tree, TRAINED, metrics=first)
  assert warning.startswith("no episode went past its first turn in 3 consecutive steps (1-3")
  assert "tree.num_turns=1" in warning
  assert resumed.observe(4, tree, TRAINED, metrics={"rollout/past_first_turn": 0.1})[0] == ""
  single = LearningWatch(RLConfig())  # a one-turn tree: every episode is one turn by design
  for step in range(1, 10):
    assert single.observe(
        step, _multi_turn_tree([_action()], num_turns=1), TRAINED, metrics=first
    ) == ("", "")
  # Both at once, and an idle step: one line each.
  both = LearningWatch(RLConfig())
  for step in (1, 2):
    both.observe(step, tree, TRAINED, metrics={**NO_CALL, **first})
  lines = both.observe(3, tree, DROPPED, metrics={**NO_CALL, **first})[0].split("\n")
  assert [line.split(":")[0] for line in lines] == [
      "step 3 trained no sample",
      "no valid tool call in 3 consecutive steps (1-3) of an environment that offers tools",
      "no episode went past its first turn in 3 consecutive "
      "steps (1-3; rollout/past_first_turn 0)",
  ]


def test_idle_hints_name_config_fields_that_exist():
  from configs import base

  config = base.get_config()
  warning, _ = LearningWatch(RLConfig()).observe(1, _tree([_action()] * 2), DROPPED)
  named = set(re.findall(r"\b([a-z]+\.[a-z_]+)\b", warning))
  assert {
      "sampling.temperature",
      "tree.num_generations",
      "optim.learning_rate",
      "loss.kl_coef",
      "rl.zero_variance_filter",
  } <= named, warning
  for text in (
      watch_lib.IDLE_HINT,
      warning,
      "raise env.max_tokens or env.max_turns",
      LearningWatch(RLConfig()).stalls(3, _multi_turn_tree([]), {}),
  ):
    for field in re.findall(r"\b([a-z]+\.[a-z_]+)\b", str(text)):
      group, name = field.split(".")
      assert name in config[group], f"{field} named in a hint is no config field"
  stalled = LearningWatch(RLConfig())
  for step in (1, 2, 3):
    lines = stalled.observe(
        step,
        _multi_turn_tree([_action()]),
        TRAINED,
        metrics={**NO_CALL, "rollout/past_first_turn": 0.0},
    )[0]
  for field in re.findall(r"\b([a-z]+\.[a-z_]+)\b", lines):
    group, name = field.split(".")
    if group not in ("tools", "rollout"):  # metric keys
      assert name in config[group], f"{field} named in a warning is no config field"


# ------------------------------------------------------------------ the entry point
MASKING_ENV = """
from mtrl_jax.envs import Environment, EnvironmentFactory, InfrastructureError


class MaskingEnv(Environment):
  def react_to(self, thread):
    raise InfrastructureError("grader service unreachable")


class MaskingFactory(EnvironmentFactory):
  outcome_range = (-1.0, 1.0)

  def create_environment(self, metadata):
    return MaskingEnv({**metadata, "prompt": metadata["question"]})
"""


@pytest.mark.slow  # a tiny model's rollout and evaluation programs compile (~30 s on 2 cores)
def test_a_run_whose_every_sample_is_masked_halts_with_status_3_and_keeps_its_files(tmp_path):
  (tmp_path / "masking_env.py").write_text(MASKING_ENV)
  workdir = tmp_path / "run"
  cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      "--config=configs/calculator.py:smoke=True",
      f"--workdir={workdir}",
      "--progress=false",
      "--config.sft.steps=0",
      "--config.env.factory=masking_env:MaskingFactory",
      "--config.env.max_retries=0",
      "--config.rl.steps=4",
      "--config.rl.halt_if_idle_steps=2",
      "--config.eval.num_tasks=2",
      "--config.eval.every=10",
  ]
  env = testing.cpu_env(1, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 3, out.stderr[-3000:]
  lines = [l for l in out.stderr.splitlines() if l.startswith(("warning: ", "halted at "))]
  assert [l.split(":")[0] for l in lines] == ["warning", "warning", "halted at step 2"], lines
  assert "every sample was masked" in lines[0] and "grader service unreachable" in lines[0]
  assert lines[-1].startswith(
      "halted at step 2: rl.halt_if_idle_steps=2: no sample trained in 2 consecutive steps (1-2)"
  ), lines[-1]
  assert "Traceback" not in out.stderr
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  assert summary["halted"] == lines[-1][len("halted at ") :]
  assert summary["trained_nothing"].startswith("the run trained no sample in 2 RL steps")
  with open(workdir / "metrics.jsonl") as f:
    assert [json.loads(l)["step"] for l in f] == [0, 1, 2]
  assert sorted(os.listdir(workdir / "ckpt"))[-1].endswith("2")  # the halted step is saved


def test_the_smoke_run_trains_and_records_its_learning_counters(smoke_run):
  summary = smoke_run.summary()
  assert "halted" not in summary and "trained_nothing" not in summary
  learning = summary["learning"]
  assert learning["steps"] == 3 and learning["trained_steps"] >= 1
