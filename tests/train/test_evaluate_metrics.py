"""Rollout reward components as metrics, and pass@k of held-out evaluation (scripted, no model)."""


import jax
import numpy as np
import pytest

from mtrl_jax import text
from mtrl_jax.envs import Environment, StepLimits, Thread, Turn
from mtrl_jax.envs.runner import StepOutcome
from mtrl_jax.graders import Grade
from mtrl_jax.graders.reward import RewardConfig, compose_reward
from mtrl_jax.rollout import TreeConfig
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.tree import Completion, Tree
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.sampling.sampler import SampleResult
from mtrl_jax.train import evaluate as eval_lib

REWARD = RewardConfig(step_penalty=-0.05, tool_penalty=-0.2, shaping_weight=0.5)


def _record(done, **parts):
  """A real step record, as `StepOutcome.to_dict()` writes it."""
  return StepOutcome(next_threads=None if done else (Thread(()),), grades={},
                     reward=compose_reward(REWARD, **parts), faults=()).to_dict()


def test_reward_components_per_valid_action_sum_over_substeps():
  tree = Tree(TreeConfig(num_turns=1, num_generations=3))
  root = tree.add_root([[1, 2]])
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  tree.set_completions(root, [[comp] * 3])
  one = _record(True, outcome=1.0, steps=1)  # 1.0 - 0.05
  # Two sub-steps: a bad tool call with a shaping grade of 0.5, then a wrong answer.
  sub = [_record(False, steps=1, invalid_calls=1, shaping=0.5), _record(True, steps=1)]
  two = {**sub[-1], "substeps": sub}  # the top level repeats the last sub-step only
  masked = _record(True, outcome=1.0, steps=1)
  totals = [0.95, -0.05 - 0.2 + 0.25 - 0.05, 0.95]
  tree.record(root, totals, valid_B=[True, True, False], infos=[one, two, masked])
  m = eval_lib.reward_metrics(tree)
  # Means over the two valid actions (the masked one is not trained on):
  assert m == pytest.approx({"reward/outcome": (1.0 + 0.0) / 2,
                             "reward/step_penalty": (-0.05 - 0.10) / 2,
                             "reward/tool_penalty": (0.0 - 0.2) / 2,
                             "reward/shaping": (0.0 + 0.25) / 2}, abs=1e-12)
  # The four parts add up to the mean reward of the valid actions.
  assert sum(m.values()) == pytest.approx(np.mean(totals[:2]), abs=1e-12)
  rollout = eval_lib.rollout_metrics(tree.finalize(), success_threshold=0.0)
  assert {k: rollout[k] for k in m} == m  # logged with every RL step


def test_path_success_weighs_each_sampled_path_not_each_ended_action():
  """Hand-worked, T = 2, G = 2. Root A: action 0 succeeds at once, action 1 continues to
  a child whose two actions succeed and fail: a sampled path succeeds with chance
  1/2 + 1/2 * 1/2 = 0.75. Root B: action 0 is masked, action 1 continues to a child
  cut at turn T without ending (no success): 0. Mean over roots 0.375. The ended-action
  share `rollout/success` is 3 / 4: it also counts the masked win."""
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  win, lose = _record(True, outcome=1.0, steps=1), _record(True, outcome=-1.0, steps=1)
  go = _record(False, steps=1)
  a = tree.add_root([[1]])
  tree.set_completions(a, [[comp] * 2])
  tree.record(a, [1.0, 0.0], infos=[win, go])
  a1 = tree.add_child(a, 1, [[1, 3, 2]])
  tree.set_completions(a1, [[comp] * 2])
  tree.record(a1, [1.0, -1.0], infos=[win, lose])
  b = tree.add_root([[2]])
  tree.set_completions(b, [[comp] * 2])
  tree.record(b, [1.0, 0.0], valid_B=[False, True], infos=[win, go])
  b1 = tree.add_child(b, 1, [[2, 3, 2]])
  tree.set_completions(b1, [[comp] * 2])
  tree.record(b1, [0.0, 0.0], infos=[go, go])
  tree.finalize()
  assert eval_lib.path_success(tree, success_threshold=0.0) == pytest.approx(0.375, abs=1e-12)
  m = eval_lib.rollout_metrics(tree, success_threshold=0.0)
  assert m["rollout/path_success"] == pytest.approx(0.375, abs=1e-12)
  assert m["rollout/success"] == pytest.approx(3 / 4, abs=1e-12)


def test_reward_metrics_empty_without_records():
  tree = Tree(TreeConfig(num_turns=1, num_generations=2))
  root = tree.add_root([[1]])
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  tree.set_completions(root, [[comp] * 2])
  tree.record(root, [0.0, 1.0])  # scripted transitions without step records
  assert eval_lib.reward_metrics(tree) == {}


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


class _ScriptedSampler:
  """Answers 'yes' on the prompt rows listed in `yes_rows`, 'no' elsewhere (G = 1)."""

  def __init__(self, tokenizer, yes_rows):
    self.tok, self.yes_rows = tokenizer, set(yes_rows)

  def generate(self, params, prompts, g, sampling, key, stop_ids, pad_id):
    assert g == 1
    rows = [self.tok.encode("yes" if p in self.yes_rows else "no") + [stop_ids[0]]
            for p in range(len(prompts))]
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
    return SampleResult(tokens=tokens, logprobs=np.full(tokens.shape, -0.1, np.float32) *
                        (tokens != pad_id), lengths=np.array([len(r) for r in rows], np.int32),
                        finish_reason=["stop"] * len(rows))


@pytest.mark.parametrize("samples, yes_rows, success, pass_k", [
    # 3 tasks x 3 attempts, rows task-major: task 0 solved on attempt 1 only,
    # task 2 on attempts 0 and 2, task 1 never.
    (3, [1, 6, 8], 3 / 9, 2 / 3),
    (1, [0, 2], 2 / 3, None),
])
def test_evaluate_samples_gives_pass_at_k(samples, yes_rows, success, pass_k):
  tok = text.ByteTokenizer()
  renderer = text.ChatRenderer(tok, text.compact(tok))
  transition = EnvTransition(renderer, 1, limits=StepLimits(max_turns=1))
  tasks = [{"task_index": i} for i in range(3)]
  evaluator = eval_lib.Evaluator(_ScriptedSampler(tok, yes_rows), renderer, transition,
                                 _Factory(), TreeConfig(num_turns=1, num_generations=4),
                                 SamplingConfig(max_new_tokens=8), success_threshold=0.0)
  out = evaluator(None, tasks, greedy=samples == 1, key=jax.random.PRNGKey(0), samples=samples)
  assert out["success"] == pytest.approx(success, abs=1e-12)
  assert out["outcome"] == pytest.approx(success, abs=1e-12)  # outcome 1 or 0 per attempt
  if pass_k is None:
    assert not any(k.startswith("pass@") for k in out)
  else:
    assert out[f"pass@{samples}"] == pytest.approx(pass_k, abs=1e-12)
  with pytest.raises(ValueError, match="samples"):
    evaluator(None, tasks, greedy=True, key=None, samples=0)
