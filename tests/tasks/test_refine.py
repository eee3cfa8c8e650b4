"""The cooperative refinement task: generation, the three feedback modes, what each makes
solvable, the single-agent arm, and the warm-up data the environment replays exactly."""

import itertools

import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, Turn, resolve_factory, rollout_scripted, step_environment
from mtrl_jax.tasks import refine
from mtrl_jax.testing import byte_renderer

PER_TURN = RewardConfig(outcome_weight=1.0, shaping_weight=1.0)
RENDERER = byte_renderer()


def make_env(task, **kw):
  return resolve_factory("refine", **kw).create_environment(task)


def test_tasks_are_deterministic_with_the_truth_among_distinct_candidates():
  a = [refine.make_task("train", i) for i in range(200)]
  assert a == [refine.make_task("train", i) for i in range(200)]
  assert a != [refine.make_task("eval", i) for i in range(200)]
  first = 0
  for t in a:
    assert t["target"] == "".join(t["parts"])
    for part, hint in zip(t["parts"], t["hints"]):
      assert part in hint and len(set(hint)) == 2
      assert all(len(c) == 2 and c[0] != "0" for c in hint)
    first += t["hints"][1][0] == t["parts"][1]
  # the order leaks nothing: the truth is listed first about half the time
  assert 70 < first < 130
  t = refine.make_task("test", 0, digits=3, hint_size=3)
  assert len(t["target"]) == 6 and all(len(h) == 3 for h in t["hints"])
  for bad, match in (
      (dict(split="dev"), "split"),
      (dict(digits=0), "digits"),
      (dict(hint_size=10), "hint_size"),
  ):
    with pytest.raises(ValueError, match=match):
      refine.make_task(**{"split": "train", "index": 0, **bad})


TASK = {
    "parts": ["37", "52"],
    "hints": [["37", "90"], ["52", "18"]],
    "target": "3752",
    "split": "eval",
    "index": 0,
}


def test_feedback_messages_worked_by_hand():
  """Agent A answered 3718 (B's half too low), agent B 9052 (A's half too high)."""
  env = make_env(TASK, num_turns=2)
  acted = [
      t.append(Turn("assistant", a))
      for t, a in zip(env.initial_threads(), ["<answer>3718</answer>", "<answer>9052</answer>"])
  ]
  assert [t.turns[0].content for t in acted] == ["A:37 B?52|18", "B:52 A?37|90"]
  nxt, grades = env.react_to_joint(acted)
  assert [t.turns[-1].content for t in nxt] == ["no A:ok B:lo", "no A:hi B:ok"]
  assert grades["joint"].score == 0.0
  assert grades["joint"].components == {
      "success": 0.0,
      "agent_0_correct": 0.0,
      "agent_1_correct": 0.0,
  }
  for mode, want in (("plain", ["no", "no"]), ("bandit", ["A:37 B?52|18", "B:52 A?37|90"])):
    env = make_env(TASK, feedback=mode)
    nxt, _ = env.react_to_joint(
        [
            t.append(Turn("assistant", a))
            for t, a in zip(
                env.initial_threads(), ["<answer>3718</answer>", "<answer>9052</answer>"]
            )
        ]
    )
    assert [t.turns[-1].content for t in nxt] == want
  # an unreadable answer: '?' for both halves, and a format fault
  env = make_env(TASK)
  nxt, _ = env.react_to_joint(
      [
          t.append(Turn("assistant", a))
          for t, a in zip(env.initial_threads(), ["3752", "<answer>375</answer>"])
      ]
  )
  assert [t.turns[-1].content for t in nxt] == ["no A:? B:?", "no A:ok B:?"]
  assert [f.kind.value for f in env.drain_faults()] == ["model_format"]


def test_a_solved_pair_is_told_ok_and_the_env_stops_after_num_turns():
  env = make_env(TASK, num_turns=3)
  right = ["<answer>3752</answer>"] * 2
  outs, seen = rollout_scripted(env, [right, right, right], reward_cfg=PER_TURN)
  assert [o.reward.total for o in outs] == [1.0, 1.0, 1.0]
  assert [o.done for o in outs] == [False, False, True]
  assert seen[1][0].turns[-2].content == "ok A:ok B:ok"  # seen: the threads as acted on


def _replay(task, mode, agents, convos):
  texts = [[c[k][1] for c in convos] for k in range(1, len(convos[0]), 2)]
  if agents == 1:
    texts = [t[0] for t in texts]
  env = make_env(task, num_turns=len(texts), feedback=mode, agents=agents)
  return rollout_scripted(env, texts, reward_cfg=PER_TURN, renderer=RENDERER)


@pytest.mark.parametrize("mode", refine.FEEDBACK_MODES)
@pytest.mark.parametrize("agents,turns", [(2, 2), (2, 3), (1, 2)])
def test_the_warmup_episodes_are_what_the_env_shows(mode, agents, turns):
  """SFT data is the env's own transcript of blind guesses: each turn's answer is the own
  half and a listed candidate, and the user turns are exactly the env's messages."""
  for index in range(6):
    task = refine.make_task("train", index)
    convos = [refine.warmup_conversation(task, a, turns, mode, agents) for a in range(agents)]
    outs, seen = _replay(task, mode, agents, convos)
    assert len(outs) == turns and outs[-1].done
    for a, thread in enumerate(seen[-1] if agents > 1 else [seen[-1]]):
      assert [(t.role, t.content) for t in thread.turns] == convos[a]
    for a, convo in enumerate(convos):
      for _, text in convo[1::2]:
        answer = text[len("<answer>") : -len("</answer>")]
        own, guess = (answer[:2], answer[2:]) if a == 0 else (answer[2:], answer[:2])
        assert own == task["parts"][a] and guess in task["hints"][1 - a]
  # agent None alternates roles over a stream of tasks (a shared policy learns both)
  roles = [refine.warmup_conversation(refine.make_task("train", i))[0][1][0] for i in range(4)]
  assert roles == ["A", "B", "A", "B"]


def _last_turn_rate(make, mode, agents=2, turns=2, n=400):
  hits = []
  for i in range(n):
    task = refine.make_task("train", i)
    answers = [make(task, a, turns, mode, agents)[-1][1] for a in range(agents)]
    hits.append(all(x == f"<answer>{task['target']}</answer>" for x in answers))
  return float(np.mean(hits))


def test_each_mode_caps_what_its_refiner_reaches_at_turn_2():
  """The refiner of each mode at K = 2: level feedback solves every task, plain one half
  (after "no" both switch: right when both were wrong, 1 of 3 failures), bandit stays at
  1/K^2; the single agent's plain refiner solves everything (its "no" is its own)."""
  golden = lambda task, a, turns, mode, agents: refine.golden_conversation(
      task, a, turns, mode, agents
  )
  assert _last_turn_rate(golden, "level_feedback") == 1.0
  assert abs(_last_turn_rate(golden, "plain") - 0.5) < 0.07
  assert abs(_last_turn_rate(golden, "bandit") - 0.25) < 0.06
  assert _last_turn_rate(golden, "plain", agents=1) == 1.0


def test_the_warmup_follows_the_refiner_in_a_fraction_of_its_episodes():
  """follow=0: 1/K^2 at the last turn in every mode; follow=1: the refiner's rate; the
  default 0.5 in between (level feedback: 1/4 + 1/2 x 3/4 for the pair's mixed episodes)."""
  for follow, level in ((0.0, 0.25), (1.0, 1.0)):
    warm = lambda task, a, turns, mode, agents: refine.warmup_conversation(
        task, a, turns, mode, agents, follow=follow
    )
    assert abs(_last_turn_rate(warm, "level_feedback") - level) < 0.06
    assert abs(_last_turn_rate(warm, "bandit") - 0.25) < 0.06
  mixed = _last_turn_rate(refine.warmup_conversation, "level_feedback")
  assert abs(mixed - 0.625) < 0.07


@pytest.mark.parametrize("hint_size,turns", [(2, 2), (3, 3)])
def test_the_golden_refiner_solves_every_task_with_level_feedback(hint_size, turns):
  """K = 2: one refinement (take the other candidate); K = 3: hi / lo leave at most two
  candidates after a wrong first guess, so the third turn at the latest."""
  per_turn = []
  for index in range(40):
    task = refine.make_task("eval", index, hint_size=hint_size)
    convos = [refine.golden_conversation(task, a, turns) for a in range(2)]
    assert convos[0][1][1][len("<answer>") + 2 :][:2] == task["hints"][1][0]  # first listed
    outs, _ = _replay(task, "level_feedback", 2, convos)
    per_turn.append([o.reward.total for o in outs])
  per_turn = np.mean(per_turn, axis=0)
  assert per_turn[-1] == 1.0
  assert 0 < per_turn[0] < 0.4 and per_turn[0] < per_turn[1]  # chance 1/K^2 at turn 1


def _plain_success(turn2: tuple) -> float:
  """Mean turn-2 success under 'plain' of a pair whose turn-2 rule is `turn2` (per agent:
  'stay' or 'switch' after "no"; keep after "ok"), over the 4 equally likely turn-1 guesses."""
  wins = []
  for guesses in itertools.product((0, 1), repeat=2):
    env = make_env(TASK, feedback="plain")
    threads = env.initial_threads()
    picks = [TASK["hints"][1 - a][g] for a, g in enumerate(guesses)]

    def act(threads):
      codes = [TASK["parts"][0] + picks[0], picks[1] + TASK["parts"][1]]
      return step_environment(
          env,
          [t.append(Turn("assistant", f"<answer>{c}</answer>")) for t, c in zip(threads, codes)],
          reward_cfg=PER_TURN,
      )

    out = act(threads)
    ok = out.next_threads[0].turns[-1].content == "ok"
    for a in range(2):
      if not ok and turn2[a] == "switch":
        picks[a] = next(c for c in TASK["hints"][1 - a] if c != picks[a])
    out = act(out.next_threads)
    wins.append(out.reward.total)
  return float(np.mean(wins))


def test_plain_feedback_caps_a_second_turn_at_one_half():
  """After "no" neither agent knows whose guess failed: no turn-2 rule beats 1/2."""
  rates = {rule: _plain_success(rule) for rule in itertools.product(("stay", "switch"), repeat=2)}
  assert rates == {
      ("stay", "stay"): 0.25,
      ("stay", "switch"): 0.5,
      ("switch", "stay"): 0.5,
      ("switch", "switch"): 0.5,
  }


def test_the_single_agent_arm_has_role_a_alone():
  env = make_env(TASK, agents=1)
  assert env.num_agents == 1 and env.initial_thread().turns[0].content == "A:37 B?52|18"
  outs, seen = rollout_scripted(
      env, ["<answer>3718</answer>", "<answer>3752</answer>"], reward_cfg=PER_TURN
  )
  assert [o.reward.total for o in outs] == [0.0, 1.0]
  assert seen[1].turns[-2].content == "no A:ok B:lo"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(feedback="hint"), "feedback"),
        (dict(agents=3), "agents"),
        (dict(num_turns=0), "num_turns"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(kw, match):
  with pytest.raises(ValueError, match=f"refine {match}=.*allowed"):
    resolve_factory("refine", **kw)
