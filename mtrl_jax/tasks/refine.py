"""A cooperative refinement task: two agents, complementary hints, graded feedback.

The hidden code is x‖y, two private halves (two digits each by default).
Agent 0 ("A") knows x and is told that y is one of K candidates; agent 1
("B") knows y and is told K candidates for x. Both must answer the whole
code; the joint action succeeds when both answers are right. Neither agent
can see everything it needs: each knows its own half and only a list of
guesses for the other's. An episode of agent 0 (compact byte-level chat,
K = 2; agent 1's mirrors it):

    user:       "A:37 B?52|18"             (own half; the partner's half is 52 or 18)
    assistant:  <answer>3718</answer>      (a guess: wrong half B)
    user:       "no A:ok B:lo"             (level feedback: the joint code failed;
                                            in this answer A's half is right, B's too low)
    assistant:  <answer>3752</answer>      (refined: the other candidate)

The candidates are in random order, so at turn 1 a guess is all either
agent can do: the joint code holds with chance 1/K^2 (K = 2: 25%; K = 3:
11%). The feedback after each joint action is what a later turn can use,
and how much it says is the `feedback` mode (CoMLRL's external modes):

  'level_feedback'  (default) the joint verdict (ok | no) and, for each half
                    of the agent's own answer, ok | hi | lo | ? (unreadable).
                    One refinement solves it: drop a candidate named wrong
                    (K = 2: take the other one; hi / lo narrow a longer list).
  'plain'           the joint verdict only. After "no" neither agent knows
                    whose guess failed (at K = 2, each of the three failed
                    joint guesses is equally likely), so a second turn
                    solves a third of the failures at best; more turns let
                    the pair search the joint candidates.
  'bandit'          the turn-1 prompt again: no information, every turn is a
                    fresh guess (CoMLRL's no-feedback control).

Reward (CoMLRL style, one grade per joint action): +1 when both answers are
the code, else 0; each agent is also graded alone (`Grade.agent_scores`: its
own answer is the code), the local reward `agents.team_weight` < 1 mixes in. The env runs all `num_turns` joint actions (a solved pair
must keep its answer; the episode does not end early, so 'bandit' carries no
verdict by its length). Held-out success is the last turn's joint success.

`agents=1` is the single-agent arm: one agent holds role A's information
(its half, K candidates for the other) and alone answers the code, so its
turn-1 chance is 1/K. There is no partner: a second agent adds a second
guess the joint check needs, not information the first lacks, so this arm
measures what the joint requirement costs.

What is learnable, and from where: `warmup_conversation` (the SFT data)
guesses a random candidate at turn 1; later turns follow the mode's refiner
in half the episodes (`follow`) and guess afresh in the others. It teaches
the format, that the partner's half is a listed candidate, and part of what
the feedback means: after the warm-up a pair succeeds at turn 1 with chance
1/K^2 and at turn 2 somewhere between that and the mode's ceiling (level
feedback: 1; plain: 1/2 at K = 2; bandit: 1/K^2). RL has to take it the rest
of the way, by reading the feedback every time. `golden_conversation` is the
refiner itself.

Tasks come from (split, index), so data order is reproducible and
resumable.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, Thread, Turn, register_env_factory
from mtrl_jax.tasks.coop import grade_joint_answers

LETTERS = ("A", "B")
FEEDBACK_MODES = ("level_feedback", "plain", "bandit")
_SPLIT_SEEDS = {"train": 20, "eval": 21, "test": 22}


def _check_int(name: str, value, lo: int, hi: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise ValueError(f"refine {name}={value!r}; allowed: an int in [{lo}, {hi}]")


def make_task(split: str, index: int, digits: int = 2, hint_size: int = 2) -> dict:
  """Task `index` of `split`: two halves and, per half, `hint_size` candidates in
  random order (the true half and distinct decoys of the same length)."""
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"refine split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  _check_int("digits", digits, 1, 6)
  _check_int("hint_size", hint_size, 1, 9)
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  lo, hi = 10 ** (digits - 1), 10**digits
  parts, hints = [], []
  for _ in LETTERS:
    picks = rng.choice(hi - lo, size=hint_size, replace=False) + lo
    parts.append(str(int(picks[0])))
    hints.append([str(int(p)) for p in rng.permutation(picks)])
  return {"parts": parts, "hints": hints, "target": "".join(parts), "split": split, "index": index}


def first_prompt(task: Mapping[str, Any], agent: int) -> str:
  """Turn-1 message of `agent`: its letter, its half, the partner's candidates."""
  other = 1 - agent
  candidates = "|".join(task["hints"][other])
  return f"{LETTERS[agent]}:{task['parts'][agent]} {LETTERS[other]}?{candidates}"


def _judge(guess: Optional[str], truth: str) -> str:
  if guess is None or len(guess) != len(truth) or not guess.isdigit():
    return "?"
  return "ok" if guess == truth else ("hi" if int(guess) > int(truth) else "lo")


def feedback_prompt(
    task: Mapping[str, Any],
    agent: int,
    answer: Optional[str],
    success: bool,
    feedback: str = "level_feedback",
) -> str:
  """The user message after a joint action, for `agent`, whose answer was `answer`."""
  if feedback == "bandit":
    return first_prompt(task, agent)
  verdict = "ok" if success else "no"
  if feedback == "plain":
    return verdict
  width = len(task["parts"][0])
  halves = (None, None) if answer is None else (answer[:width], answer[width:])
  marks = " ".join(f"{LETTERS[h]}:{_judge(halves[h], task['parts'][h])}" for h in range(2))
  return f"{verdict} {marks}"


def _render(task, agent: int, answers_per_turn, feedback: str) -> list[tuple[str, str]]:
  """One agent's (role, content) episode given every agent's answer at each turn."""
  msgs = [("user", first_prompt(task, agent))]
  for t, answers in enumerate(answers_per_turn):
    if t:
      prev = answers_per_turn[t - 1]
      success = all(a == task["target"] for a in prev)
      msgs.append(("user", feedback_prompt(task, agent, prev[agent], success, feedback)))
    msgs.append(("assistant", f"<answer>{answers[agent]}</answer>"))
  return msgs


def _own_and(task, agent: int, guess: str) -> str:
  return task["parts"][0] + guess if agent == 0 else guess + task["parts"][1]


def _play(task, num_turns: int, feedback: str, agents: int, refine: bool, pick) -> list:
  """Every agent's answer at each turn. `refine` False: a fresh guess every turn. True:
  the refiner of the mode: 'level_feedback' drops the candidates the marks rule out,
  'plain' keeps its guess after ok and tries another after no, 'bandit' (nothing to
  read) guesses afresh. `pick(candidates)` chooses among those left."""
  left = [list(task["hints"][1 - a]) for a in range(agents)]
  guesses = [pick(left[a]) for a in range(agents)]
  answers = [[_own_and(task, a, guesses[a]) for a in range(agents)]]
  for _ in range(1, num_turns):
    success = all(a == task["target"] for a in answers[-1])
    for a in range(agents):
      truth, g = task["parts"][1 - a], guesses[a]
      if not refine or feedback == "bandit":
        options = left[a]
      elif feedback == "level_feedback":
        mark = _judge(g, truth)
        left[a] = options = [
            c
            for c in left[a]
            if mark == "ok"
            and c == g
            or mark == "hi"
            and int(c) < int(g)
            or mark == "lo"
            and int(c) > int(g)
        ]
      else:  # plain
        options = [g] if success else [c for c in left[a] if c != g]
      guesses[a] = pick(options)
    answers.append([_own_and(task, a, guesses[a]) for a in range(agents)])
  return answers


def warmup_conversation(
    task: Mapping[str, Any],
    agent: Optional[int] = None,
    num_turns: int = 2,
    feedback: str = "level_feedback",
    agents: int = 2,
    follow: float = 0.5,
) -> list:
  """SFT data: with chance `follow` the mode's refiner (`_play`), else a fresh random
  guess every turn, blind to the feedback; turn 1 is a random candidate either way.

  The warm-up so teaches the format, that the partner's half is a listed
  candidate, and part of what the feedback means; RL has the rest to learn.
  Draws come from a generator seeded by the task, so the partner's simulated
  answers (which set the joint verdict) are fixed too. `agent` None picks
  `task['index'] % agents`, so a stream of tasks gives a shared policy both
  roles.
  """
  agent = int(task.get("index", 0)) % agents if agent is None else agent
  rng = np.random.default_rng([_SPLIT_SEEDS[task["split"]], int(task["index"]), 1])
  refine = bool(rng.random() < follow)
  answers = _play(task, num_turns, feedback, agents, refine, lambda c: str(rng.choice(c)))
  return _render(task, agent, answers, feedback)


def golden_conversation(
    task: Mapping[str, Any],
    agent: Optional[int] = None,
    num_turns: int = 2,
    feedback: str = "level_feedback",
    agents: int = 2,
) -> list:
  """The mode's refiner, always taking the first candidate left: under
  'level_feedback' every task is solved by turn 2 (K = 2) or 3 (K = 3)."""
  agent = int(task.get("index", 0)) % agents if agent is None else agent
  return _render(
      task, agent, _play(task, num_turns, feedback, agents, True, lambda c: c[0]), feedback
  )


class RefineEnv(Environment):
  """Joint code from complementary hints; graded feedback between joint actions.

  Args:
    metadata: a `make_task` dict.
    num_turns: joint actions per episode; the env stops after the last.
    feedback: one of FEEDBACK_MODES.
    agents: 2, or 1 for the single-agent arm (role A's information, no partner).
  """

  def __init__(
      self,
      metadata: Mapping[str, Any],
      num_turns: int = 2,
      feedback: str = "level_feedback",
      agents: int = 2,
  ):
    super().__init__(metadata)
    _check_int("num_turns", num_turns, 1, 64)
    _check_int("agents", agents, 1, 2)
    if feedback not in FEEDBACK_MODES:
      raise ValueError(f"refine feedback={feedback!r}; allowed: {list(FEEDBACK_MODES)}")
    for key in ("parts", "hints", "target"):
      if key not in self.metadata:
        raise ValueError(f"refine task lacks {key!r}; build tasks with refine.make_task")
    self.num_turns, self.feedback, self.num_agents = num_turns, feedback, agents

  def initial_threads(self) -> list[Thread]:
    return [
        Thread((Turn("user", first_prompt(self.metadata, i)),), dict(self.metadata))
        for i in range(self.num_agents)
    ]

  def initial_thread(self) -> Thread:
    return self.initial_threads()[0]

  def react_to(self, thread: Thread):
    threads, grades = self.react_to_joint([thread])
    return (None if threads is None else threads[0]), grades

  def react_to_joint(self, threads: Sequence[Thread]):
    if len(threads) != self.num_agents:
      raise ValueError(f"RefineEnv has {self.num_agents} agents, got {len(threads)} threads")
    answers, success, grades = grade_joint_answers(self, threads, self.metadata["target"], "refine")
    if threads[0].count("assistant") >= self.num_turns:
      return None, grades
    return [
        t.append(
            Turn("user", feedback_prompt(self.metadata, i, answers[i], success, self.feedback))
        )
        for i, t in enumerate(threads)
    ], grades


@register_env_factory("refine")
class RefineFactory(EnvironmentFactory):
  """Fresh `RefineEnv` per trajectory; arguments as `RefineEnv`'s."""

  def __init__(self, num_turns: int = 2, feedback: str = "level_feedback", agents: int = 2):
    RefineEnv(make_task("train", 0), num_turns, feedback, agents)  # validates
    self.num_turns, self.feedback, self.num_agents = num_turns, feedback, agents

  def create_environment(self, metadata: Mapping[str, Any]) -> RefineEnv:
    return RefineEnv(metadata, self.num_turns, self.feedback, self.num_agents)


@data.register_task_source("refine")
def refine_tasks(
    split: str, size: Optional[int] = None, digits: int = 2, hint_size: int = 2
) -> data.GeneratedTasks:
  return data.GeneratedTasks(
      make_task,
      split,
      size or (100_000 if split == "train" else 200),
      digits=digits,
      hint_size=hint_size,
  )
