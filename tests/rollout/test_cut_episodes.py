"""Episodes the tree cuts at its last turn are graded as ended and counted; per-turn
grades under reward.shaping_weight=0 are reported once."""

import dataclasses

import jax
import numpy as np
import pytest

from mtrl_jax.envs import (
    Environment,
    EnvironmentFactory,
    Grade,
    RewardConfig,
    StepLimits,
    Thread,
    Turn,
)
from mtrl_jax.envs.cuts import grade_cut
from mtrl_jax.envs.fault_report import FAULT_CONSOLE
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.stats import cut_metrics, path_results, rollout_metrics
from mtrl_jax.testing import FakePolicy, byte_renderer, byte_tokenizer
from mtrl_jax.text import compact

TOK = byte_tokenizer()
FMT = compact(TOK)
ASSISTANT = TOK.token_to_id("<|assistant|>")
REWARD = RewardConfig(step_penalty=-0.05, shaping_weight=0.1)
CUT_LINE = "tree.num_turns=2"
SHAPING_LINE = "reward.shaping_weight=0"


class GuessEnv(Environment):
  """A hidden integer in [1, 64]; the user answers "higher"/"lower"; +1 on a hit, -1
  after 4 guesses or for a reply that is not a number. Every other guess is graded
  per turn by how close it came (shaping)."""

  def __init__(self, metadata):
    super().__init__({**metadata, "prompt": "Guess my number in [1, 64]."})
    self.guesses = 0

  def react_to(self, thread):
    secret = self.metadata["secret"]
    try:
      guess = int(thread.last_assistant.strip())
    except ValueError:
      return None, Grade(-1.0, "not a number")
    self.guesses += 1
    if guess == secret:
      return None, Grade(1.0, "hit")
    if self.guesses >= 4:
      return None, Grade(-1.0, "four guesses missed")
    closeness = {"closeness": Grade(1.0 - abs(guess - secret) / 64)}
    return thread.append(Turn("user", "higher" if guess < secret else "lower")), closeness


class GuessFactory(EnvironmentFactory):
  outcome_range = (-1.0, 1.0)

  def create_environment(self, metadata):
    return GuessEnv(metadata)


class ScriptedGuesser(FakePolicy):
  """Sample g at the k-th policy turn of an episode writes `script[k][g]`."""

  def __init__(self, script):
    super().__init__(vocab=TOK.vocab_size)
    self.script = script

  def completion(self, req, g):
    turn = int(np.sum(np.asarray(req.prompt) == ASSISTANT)) - 1
    text = self.script[turn][g % len(self.script[turn])]
    ids = np.asarray([*text.encode(), FMT.stop_ids[0]], np.int32)
    return ids, np.full(ids.shape, -0.5, np.float32), "stop"


class NoCutTransition(EnvTransition):
  """The transition as it was before cuts were graded: a last-turn step that goes on
  just ends its branch."""

  cut = None


def _tree(
    script,
    num_turns,
    *,
    secret=64,
    generations=1,
    reward=REWARD,
    transition_cls=EnvTransition,
    limits=StepLimits(),
    key=0,
):
  transition = transition_cls(
      byte_renderer(), reward_cfg=reward, limits=limits, outcome_range=GuessFactory.outcome_range
  )
  cfg = TreeConfig(num_turns=num_turns, num_generations=generations)
  roots = transition.root_states(GuessFactory(), [{"secret": secret}])
  return expand_tree(cfg, ScriptedGuesser(script), transition, roots, jax.random.key(key))


def _path_return(tree):
  (res,) = path_results(tree)
  return res


@pytest.fixture(autouse=True)
def _fresh_console():
  FAULT_CONSOLE.reset()
  yield
  FAULT_CONSOLE.reset()


def test_a_four_guess_game_under_two_turns_is_cut_and_counted():
  tree = _tree([["32"], ["48"]], num_turns=2, generations=2)
  # 2 root actions go on, each child's 2 actions would go on past turn 1: 4 cuts.
  assert cut_metrics(tree) == {"tree/cut_episodes": 4.0, "tree/cut_fraction": 1.0}
  m = rollout_metrics(tree, success_threshold=0.5)
  assert m["tree/cut_episodes"] == 4.0 and m["rollout/path_success"] == 0.0
  for node in tree.level(1):
    for action in node.actions:
      step = action.steps[-1]
      assert action.cut and action.ended and step.done and not step.truncated
      assert step.details["cut_grades"]["cut"]["score"] == -1.0  # the failure outcome
      assert step.parts["outcome"] == -1.0 and step.parts["shaping"] == 0.0
      assert "closeness" in step.details["grades"]  # kept in the record, out of the reward


def test_a_cut_never_pays_more_than_failing_at_that_turn():
  cut = _path_return(_tree([["32"], ["48"]], num_turns=2))
  # The same first guess, then a reply the game ends as a failure.
  failed = _path_return(_tree([["32"], ["pass"]], num_turns=2))
  assert cut["cut"] and not failed["cut"]
  assert cut["outcome"] == failed["outcome"] == -1.0
  assert cut["return"] == pytest.approx(failed["return"], abs=1e-12)
  # Before, the cut earned the shaping and penalties only: more than a finished failure
  # of the whole game (4 misses).
  old = _path_return(_tree([["32"], ["48"]], num_turns=2, transition_cls=NoCutTransition))
  four_misses = _path_return(_tree([["32"], ["48"], ["56"], ["60"]], num_turns=4))
  assert old["outcome"] == 0.0 and old["return"] > four_misses["return"]
  assert cut["return"] < old["return"]
  assert not four_misses["cut"] and four_misses["outcome"] == -1.0


def test_an_environment_that_ends_within_the_tree_keeps_its_arrays():
  # Sample 1 hits at once, sample 0 on its second guess: every episode ends by turn 1.
  script = [["32", "48"], ["48"]]
  new = _tree(script, num_turns=2, secret=48, generations=2)
  old = _tree(script, num_turns=2, secret=48, generations=2, transition_cls=NoCutTransition)
  assert cut_metrics(new)["tree/cut_episodes"] == 0.0
  assert len(new.nodes) == len(old.nodes) == 2
  for a, b in zip(new.nodes, old.nodes):
    for name in ("rewards_B", "returns_B", "advantages_NxG", "weight_NxG", "children_B"):
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  root, gamma = new.nodes[0], new.cfg.discount
  first = -0.05 + 0.1 * (1.0 - 16 / 64)  # a step, shaped by how close 32 came to 48
  np.testing.assert_allclose(root.rewards_B, [first, 0.95], atol=1e-12)
  np.testing.assert_allclose(root.returns_B, [first + gamma * 0.95, 0.95], atol=1e-12)


def test_the_cut_notice_prints_once_naming_the_limits(capsys):
  for key in range(2):
    _tree([["32"], ["48"]], num_turns=2, generations=2, limits=StepLimits(max_turns=8), key=key)
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if CUT_LINE in line]
  assert len(lines) == 1
  assert "env.max_turns=8 lets episodes run longer" in lines[0]
  assert "tree/cut_episodes" in lines[0]


def test_no_cut_notice_when_episodes_end_within_the_tree(capsys):
  _tree([["32", "48"], ["48"]], num_turns=2, secret=48, generations=2)
  assert CUT_LINE not in capsys.readouterr().err


def test_on_cut_grades_replace_the_failure_outcome():

  class Partial(GuessEnv):

    def on_cut(self, thread):
      return {"progress": Grade(-0.5, f"{self.guesses} guesses, no hit")}

  class PartialFactory(GuessFactory):

    def create_environment(self, metadata):
      return Partial(metadata)

  env = PartialFactory().create_environment({"secret": 64})
  grades, faults, masked = grade_cut(env, env.initial_thread(), -1.0)
  assert grades["progress"].score == -0.5 and not faults and not masked
  # No on_cut grades (the default: finalize, None): the failure outcome.
  grades, _, _ = grade_cut(GuessEnv({"secret": 64}), Thread(), -1.0, num_turns=2)
  assert grades["cut"].score == -1.0 and "last turn (2)" in grades["cut"].reason


def test_an_on_cut_that_raises_masks_the_action():

  class Broken(GuessEnv):

    def on_cut(self, thread):
      raise KeyError("bug in on_cut")

  grades, faults, masked = grade_cut(Broken({"secret": 64}), Thread(), -1.0)
  assert masked and faults[0].kind.value == "contract" and "on_cut" in faults[0].where
  assert grades["cut"].score == -1.0


def test_per_turn_grades_under_zero_weight_are_reported_once(capsys):
  reward = dataclasses.replace(REWARD, shaping_weight=0.0)
  for key in range(2):
    _tree([["32"], ["48"]], num_turns=2, generations=2, reward=reward, key=key)
  lines = [line for line in capsys.readouterr().err.splitlines() if SHAPING_LINE in line]
  assert len(lines) == 1 and "(closeness)" in lines[0]


def test_per_turn_grades_with_a_weight_are_not_reported(capsys):
  _tree([["32"], ["48"]], num_turns=2, generations=2, reward=REWARD)
  assert SHAPING_LINE not in capsys.readouterr().err


def test_the_weather_template_grades_a_cut_as_a_wrong_answer():
  from mtrl_jax.tasks.weather import WeatherFactory

  env = WeatherFactory().create_environment({"city": "oslo"})
  thread = env.initial_thread().append(
      Turn("assistant", '<tool_call>{"name": "get_weather"}</tool_call>'),
      Turn("tool", "4", name="get_weather"),
  )
  wrong = env.initial_thread().append(Turn("assistant", "<answer>5</answer>"))
  _, final = env.react_to(wrong)
  assert env.on_cut(thread)["final"].score == final["final"].score
