"""The cooperative two-agent CPU task: generation, feedback, rewards, tree credit, config."""

import re

import jax
import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, Turn, resolve_factory, rollout_scripted, step_environment
from mtrl_jax.tasks import coop
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.testing import FakePolicy, byte_renderer

PER_TURN = RewardConfig(outcome_weight=1.0, shaping_weight=1.0)
RENDERER = byte_renderer()
TOK = RENDERER.tokenizer


def make_env(task, **kw):
  return resolve_factory("coop", **kw).create_environment(task)


def test_tasks_are_deterministic_and_splits_differ():
  a = [coop.make_task("train", i) for i in range(30)]
  assert a == [coop.make_task("train", i) for i in range(30)]
  assert a != [coop.make_task("eval", i) for i in range(30)]
  for t in a:
    assert all(len(p) == 2 and p[0] != "0" for p in t["parts"])
    assert t["target"] == t["parts"][0] + t["parts"][1]
  assert len(coop.make_task("test", 0, digits=3)["target"]) == 6
  for bad, match in ((dict(split="dev"), "split"), (dict(digits=0), "digits")):
    with pytest.raises(ValueError, match=match):
      coop.make_task(**{"split": "train", "index": 0, **bad})


def test_golden_joint_episode_gets_the_max_reward():
  task = coop.make_task("eval", 4)
  x, y = task["parts"]
  convos = [coop.golden_conversation(task, i) for i in range(2)]
  assert convos[0] == [
      ("user", f"A:{x}"),
      ("assistant", f"<answer>{x}</answer>"),
      ("user", f"B:{y} no"),
      ("assistant", f"<answer>{x}{y}</answer>"),
  ]
  texts = [[c[k][1] for c in convos] for k in (1, 3)]  # per turn, one text per agent
  outs, seen = rollout_scripted(make_env(task), texts, reward_cfg=PER_TURN, renderer=RENDERER)
  assert [o.done for o in outs] == [False, True]
  # turn 1 cannot score (each half is private); turn 2 is the joint success, the max 1
  assert [o.reward.total for o in outs] == [0.0, 1.0]
  assert outs[1].grades["joint"].components == {
      "success": 1.0,
      "agent_0_correct": 1.0,
      "agent_1_correct": 1.0,
  }
  for i, thread in enumerate(seen[1]):  # the env's turns are exactly the SFT data's
    assert [(t.role, t.content) for t in thread.turns] == convos[i]
    per_turn = np.bincount(np.asarray(thread.ledger.turn))
    assert per_turn.max() < 40 and len(thread.ledger) < 40  # short byte-level episodes


def test_non_cooperative_episodes_score_nothing():
  task = coop.make_task("eval", 5)
  x, y = task["parts"]
  own = [f"<answer>{x}</answer>", f"<answer>{y}</answer>"]  # each keeps to its own half
  outs, _ = rollout_scripted(make_env(task), [own, own], reward_cfg=PER_TURN)
  assert [o.reward.total for o in outs] == [0.0, 0.0]
  half = [f"<answer>{x}{y}</answer>", f"<answer>{y}</answer>"]  # one right answer is not enough
  outs, _ = rollout_scripted(make_env(task), [own, half], reward_cfg=PER_TURN)
  assert outs[1].reward.total == 0.0
  assert outs[1].grades["joint"].components["agent_0_correct"] == 1.0


def cooperative_policy(users: list, agent: int, reveal: bool = True) -> str:
  """Turn 1: reveal the own half; later: own + partner's half (A's first) from the feedback.

  `users` are the user messages the agent has seen, oldest first.
  """
  own = users[0].split(":")[1]
  if len(users) == 1:
    return f"<answer>{own if reveal else '00'}</answer>"
  m = re.match(r"[AB]:(\d+) ", users[-1])
  partner = m.group(1) if m else "10"  # no channel: guess
  return f"<answer>{own + partner if agent == 0 else partner + own}</answer>"


def play(env, policy):
  threads, rewards = env.initial_threads(), []
  for step in range(env.num_turns):
    acted = [
        t.append(Turn("assistant", policy([u.content for u in t.turns if u.role == "user"], i)))
        for i, t in enumerate(threads)
    ]
    out = step_environment(env, acted, reward_cfg=PER_TURN, step_index=step)
    rewards.append(out.reward.total)
    if out.done:
      return rewards
    threads = list(out.next_threads)


def test_turn2_feedback_is_the_channel():
  task = coop.make_task("eval", 6)
  assert play(make_env(task), cooperative_policy) == [0.0, 1.0]
  # without the partner's answer the same policy is blind at turn 2
  assert play(make_env(task, show_partner=False), cooperative_policy) == [0.0, 0.0]
  env = make_env(task, show_partner=False)
  nxt, _ = env.react_to_joint(
      [t.append(Turn("assistant", "<answer>1</answer>")) for t in env.initial_threads()]
  )
  assert [t.turns[-1].content for t in nxt] == ["no", "no"]


def test_feedback_text_success_flag_and_format_faults():
  task = coop.make_task("train", 0)
  x, y = task["parts"]
  env = make_env(task, num_turns=3)
  threads = [
      t.append(Turn("assistant", text))
      for t, text in zip(env.initial_threads(), [f"<answer>{x}{y}</answer>", "no tags"])
  ]
  nxt, grades = env.react_to_joint(threads)
  assert [t.turns[-1].content for t in nxt] == ["B:? no", f"A:{x}{y} no"]
  faults = env.drain_faults()
  assert [(f.kind.value, f.message) for f in faults] == [
      ("model_format", "agent 1: no <answer>...</answer>")
  ]
  both = [t.append(Turn("assistant", f"<answer>{x}{y}</answer>")) for t in nxt]
  nxt, grades = env.react_to_joint(both)
  assert grades["joint"].score == 1.0 and nxt[0].turns[-1].content == f"B:{x}{y} ok"


def test_team_reward_any_scores_one_right_answer_and_keeps_each_agents_own_grade():
  task = coop.make_task("train", 3)
  x, y = task["parts"]
  answers = [f"<answer>{x}{y}</answer>", f"<answer>{y}{x}</answer>"]
  scores = {}
  for team in ("all", "any"):
    env = make_env(task, team_reward=team)
    nxt, grades = env.react_to_joint(
        [t.append(Turn("assistant", a)) for t, a in zip(env.initial_threads(), answers)]
    )
    grade = grades["joint"]
    scores[team] = (grade.score, grade.agent_scores, nxt[0].turns[-1].content[-2:])
  # 'all': one right answer of two fails the team; 'any': it carries the team (and the
  # verdict the agents read says ok). The local grades are each agent's own hit either way.
  assert scores == {"all": (0.0, {0: 1.0, 1: 0.0}, "no"), "any": (1.0, {0: 1.0, 1: 0.0}, "ok")}
  with pytest.raises(ValueError, match="team_reward='some'; allowed: \\['all', 'any'\\]"):
    make_env(task, team_reward="some")


class ThreadPolicy(FakePolicy):
  """Plays `cooperative_policy` on the decoded prompt (G equal samples)."""

  def __init__(self, reveal_agent0=True):
    super().__init__()
    self.reveal_agent0 = reveal_agent0

  def completion(self, req, g):
    users = re.findall(r"<\|user\|>(.*?)<\|end\|>", TOK.decode(list(req.prompt)))
    text = cooperative_policy(users, req.agent, reveal=self.reveal_agent0 or req.agent == 1)
    ids = TOK.encode(text) + [RENDERER.fmt.stop_ids[0]]
    return np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop"


@pytest.mark.parametrize("reveal,root_return", [(True, 0.9), (False, 0.0)])
def test_tree_credits_revealing_through_the_discounted_return(reveal, root_return):
  transition = EnvTransition(RENDERER, num_agents=2, reward_cfg=PER_TURN)
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=0.9)
  roots = [transition.root_state(make_env(coop.make_task("eval", i))) for i in range(3)]
  tree = expand_tree(cfg, ThreadPolicy(reveal), transition, roots, jax.random.key(0))
  assert len(tree.nodes) == 3 * (1 + 2)
  for node in tree.nodes:
    if node.turn == 0:  # R = 0 + 0.9 * mean(child returns): 0.9 only if agent 0 revealed
      assert np.allclose(node.rewards_B, 0.0) and np.allclose(node.returns_B, root_return)
    else:
      assert np.allclose(node.rewards_B, root_return / 0.9)


def test_sft_conversations_cover_both_roles():
  tasks = [coop.make_task("train", i) for i in range(4)]
  firsts = [coop.golden_conversation(t)[0][1][0] for t in tasks]
  assert firsts == ["A", "B", "A", "B"]  # agent = index parity
  assert coop.golden_conversation_agent1(tasks[0]) == coop.golden_conversation(tasks[0], 1)
  ledger = RENDERER.render_conversation(coop.golden_conversation_agent0(tasks[0]))
  trained = TOK.decode([i for i, t in zip(ledger.ids, ledger.trainable) if t])
  x, y = tasks[0]["parts"]
  assert trained == f"<answer>{x}</answer><|end|><answer>{x}{y}</answer><|end|>"
  assert len(coop.golden_conversation(tasks[0], 0, num_turns=3)) == 6


def test_task_source_and_config_build():
  from configs import coop as coop_config
  from mtrl_jax import data
  from mtrl_jax.registry import import_object
  from mtrl_jax.run import components, experiment

  src = data.resolve_task_source("coop", "eval")
  assert len(src) == 200 and src[3] == coop.make_task("eval", 3)
  with pytest.raises(IndexError):
    src[200]
  for arg in ("", "smoke=True"):
    c = coop_config.get_config(arg)
    c.tree.num_turns = 3  # one FieldReference: the env and the turn cap follow
    exp = experiment.build(c)
    assert exp.tree.num_agents == 2 and exp.tree.branch_on == "every_turn"
    assert dict(exp.env.kwargs)["num_turns"] == 3 == exp.env.max_turns
    assert exp.reward.shaping_weight == exp.reward.outcome_weight == 1.0
    env = components.make_factory(exp).create_environment(src[0])
    assert env.num_turns == 3 and env.show_partner
  assert import_object(exp.sft.conversations) is coop.golden_conversation
