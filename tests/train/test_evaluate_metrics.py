"""pass@k of held-out evaluation through the engine policy (scripted engine, no model)."""

import jax
import numpy as np
import pytest

from mtrl_jax import text
from mtrl_jax.envs import Environment, StepLimits, Thread, Turn
from mtrl_jax.graders import Grade
from mtrl_jax.rollout import EnginePolicy, TreeConfig
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.run import evaluate as eval_lib
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.testing import FakePolicy


# ------------------------------------------------------------------ pass@k
class _YesEnv(Environment):
  """One turn: outcome 1 when the answer is 'yes'."""

  def initial_thread(self):
    return Thread((Turn("user", f"task {self.metadata['task_index']}?"),), dict(self.metadata))

  def react_to(self, thread):
    return None, Grade(float(thread.last_assistant.strip() == "yes"))


class _Factory:

  def create_environment(self, metadata):
    return _YesEnv(metadata)


class _ScriptedEngine(FakePolicy):
  """An engine answering 'yes' to the roots listed in `yes_rows`, 'no' elsewhere (G = 1):
  a root's one sample draws row (root index) in its level (`policy.request_rows`)."""

  num_agents = 1

  def __init__(self, tokenizer, yes_rows):
    super().__init__()
    self.tok, self.yes_rows = tokenizer, set(yes_rows)
    self.stats = {}

  def start(self, params, sampling, stop_ids, pad_id, *, fanout):
    self.stop = stop_ids[0]

  def completion(self, req, g):
    ids = self.tok.encode("yes" if int(req.rows[g]) in self.yes_rows else "no") + [self.stop]
    return np.asarray(ids, np.int32), np.full(len(ids), -0.1, np.float32), "stop"


@pytest.mark.parametrize(
    "samples, yes_rows, success, pass_k",
    [
        # 3 tasks x 3 attempts, rows task-major: task 0 solved on attempt 1 only,
        # task 2 on attempts 0 and 2, task 1 never.
        (3, [1, 6, 8], 3 / 9, 2 / 3),
        (1, [0, 2], 2 / 3, None),
    ],
)
def test_evaluate_samples_gives_pass_at_k(samples, yes_rows, success, pass_k):
  tok = text.ByteTokenizer()
  renderer = text.ChatRenderer(tok, text.compact(tok))
  transition = EnvTransition(renderer, 1, limits=StepLimits(max_turns=1))
  tasks = [{"task_index": i} for i in range(3)]
  engine = EnginePolicy(
      _ScriptedEngine(tok, yes_rows),
      None,
      SamplingConfig(),
      stop_ids=renderer.fmt.stop_ids,
      pad_id=tok.pad_id,
  )
  evaluator = eval_lib.Evaluator(
      engine,
      transition,
      _Factory(),
      TreeConfig(num_turns=1, num_generations=4),
      SamplingConfig(max_new_tokens=8),
      success_threshold=0.0,
  )
  out = evaluator(None, tasks, greedy=samples == 1, key=jax.random.PRNGKey(0), samples=samples)
  assert out["success"] == pytest.approx(success, abs=1e-12)
  assert out["outcome"] == pytest.approx(success, abs=1e-12)  # outcome 1 or 0 per attempt
  if pass_k is None:
    assert not any(k.startswith("pass@") for k in out)
  else:
    assert out[f"pass@{samples}"] == pytest.approx(pass_k, abs=1e-12)
  with pytest.raises(ValueError, match="samples"):
    evaluator(None, tasks, greedy=True, key=None, samples=0)


# ------------------------------------------------------------------ per-agent local grades
def test_held_out_local_means_count_only_paths_that_graded_the_agent_alone():
  """Two-agent single paths built by hand: agent a's `local` is its own grade of the
  ending joint action, averaged over the unmasked paths that graded it alone."""
  from mtrl_jax.rollout import Tree
  from mtrl_jax.rollout.records import ActionRecord, StepRecord
  from mtrl_jax.rollout.stats import path_results

  cfg = TreeConfig(num_turns=2, num_generations=1, num_agents=2)
  tree = Tree(cfg)
  # (turn-0 step, ending step) per root: team reward, validity, local grades.
  paths = [
      ((0.0, True, ()), (1.0, True, (1.0, 0.0))),  # agent 0 right, agent 1 wrong
      ((0.0, True, ()), (1.0, True, (1.0, 1.0))),  # both right
      ((0.0, True, (0.0, 0.0)), (0.0, True, ())),  # graded alone at turn 0 only
      ((0.0, True, ()), (0.0, False, (0.0, 1.0))),  # a masked ending: not counted
  ]
  for first, last in paths:
    node = tree.add_root([[1], [1]])
    for k, (team, valid, local) in enumerate((first, last)):
      rec = ActionRecord((StepRecord(team, valid, done=k == 1, local_rewards=local),))
      tree.record(node, [rec.reward], [valid], [rec])
      if k == 0:
        node = tree.add_child(node, 0, [[2], [2]])
  tree.finalize()
  res = path_results(tree)
  assert [r["local_graded"] for r in res] == [[True, True], [True, True], [False, False]] + [
      [True, True]
  ]
  assert res[0]["local"] == [1.0, 0.0] and res[2]["local"] == [0.0, 0.0]  # team where ungraded
  assert eval_lib.agent_local_means(res, 2) == {"agent_0/local": 1.0, "agent_1/local": 0.5}
  assert eval_lib.agent_local_means(res[2:3], 2) == {}  # never graded alone at the end
  assert eval_lib.agent_local_means(res, 1) == {}
