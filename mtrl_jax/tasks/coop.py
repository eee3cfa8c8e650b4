"""A two-agent cooperative CPU task: build a shared code from two private halves.

Each agent holds a private number: agent 0 ("A") sees x, agent 1 ("B") sees y
(two digits each by default). The pair must both answer the joint code
x‖y, x's digits then y's (e.g. x = 37, y = 52: both answer 3752). An episode
(compact byte-level chat, agent 0's thread; agent 1's mirrors it):

    user:       "A:37"                   (turn 1: the agent's letter and its half)
    assistant:  <answer>37</answer>      (golden: reveal its own half)
    user:       "B:52 no"                (turn 2: the partner's turn-1 answer, and
                                          whether the joint code held: ok | no)
    assistant:  <answer>3752</answer>    (golden: own half + partner's half, A first)

Reward of every joint action (CoMLRL style, one grade per turn): +1 when both
answers equal x‖y, else 0 (`team_reward='all'`). The grade also scores each agent alone
(`Grade.agent_scores`: 1 when its own answer is x‖y), the local reward that
`agents.team_weight` < 1 mixes in. The env stops itself after `num_turns` joint
actions, so configs weigh per-turn grades and the final one alike
(`reward.shaping_weight = reward.outcome_weight = 1`, configs/coop.py).

Why it needs cooperation: the reward is joint (one right answer scores
nothing) and neither agent can compute the code alone: each knows only its own
half, so at turn 1 the best either can do is guess the other's (1 in 90). The
halves can only travel through the agents' own answers: agent 0's turn-1
answer is worth something only because agent 1 reads it at turn 2 and vice
versa, so an agent that keeps its half to itself makes its partner fail.
Credit for revealing reaches turn 1 only through the discounted return of
turn 2 (R = r + gamma * mean child return), i.e. through the tree.

Why turn-2 feedback helps: it is the only channel between the agents. With
`show_partner=False` (the ablation: the user turn says only ok / no) turn 2
is as blind as turn 1, and the joint success rate stays at chance.

A team reward that lets an agent free-ride (`team_reward='any'`): the team
scores +1 when ANY agent answers x‖y (a best-of-team reward: the team
submits whichever answer is right). Each agent still needs its partner's
turn-1 reveal, but at turn 2 one agent that answers right carries the team,
so under the team reward alone the other's answer earns nothing once its
partner is reliable: the setting where a lazy agent is a local optimum and
local rewards (`agents.team_weight` < 1) or marginal credit
(`tree.joint_mode='marginal'`, which also logs each agent's influence) are
meant to help. The local grades are unchanged (each agent's own hit).

A byte-level episode is under 40 tokens per agent per turn (about 30 in
all). Tasks are generated from (split, index), so data order is reproducible
and resumable; `golden_conversation` gives SFT data for either agent.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, Thread, Turn, register_env_factory
from mtrl_jax.envs.grades import Grade
from mtrl_jax.text.tool_calls import extract_answer

LETTERS = ("A", "B")
_SPLIT_SEEDS = {"train": 10, "eval": 11, "test": 12}
GRADE_NAME = "joint"


def make_task(split: str, index: int, digits: int = 2) -> dict:
  """Task `index` of `split`: two private halves (no leading zeros) and the joint code."""
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"coop split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 6:
    raise ValueError(f"coop digits={digits!r}; must be an int in [1, 6]")
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  lo, hi = 10 ** (digits - 1), 10**digits
  parts = [str(int(rng.integers(lo, hi))) for _ in LETTERS]
  return {"parts": parts, "target": "".join(parts), "split": split, "index": index}


def first_prompt(task: Mapping[str, Any], agent: int) -> str:
  """Turn-1 user message of `agent`: its letter and its private half."""
  return f"{LETTERS[agent]}:{task['parts'][agent]}"


def feedback_prompt(
    agent: int, partner_answer: Optional[str], success: bool, show_partner: bool = True
) -> str:
  """Turn t+1 user message of `agent`: the partner's last answer and ok | no."""
  verdict = "ok" if success else "no"
  if not show_partner:
    return verdict
  shown = "?" if partner_answer is None else partner_answer[:12]
  return f"{LETTERS[1 - agent]}:{shown} {verdict}"


def golden_conversation(
    task: Mapping[str, Any], agent: Optional[int] = None, num_turns: int = 2
) -> list[tuple[str, str]]:
  """The ideal episode of one agent as (role, content) pairs (SFT data).

  Args:
    task: a `make_task` dict.
    agent: 0 or 1; None picks `task['index'] % 2`, so a stream of tasks gives
      a shared policy both roles.
    num_turns: turns of the episode.
  """
  agent = int(task.get("index", 0)) % 2 if agent is None else agent
  partner = task["parts"][1 - agent]
  msgs = [
      ("user", first_prompt(task, agent)),
      ("assistant", f"<answer>{task['parts'][agent]}</answer>"),
  ]
  success = False
  for turn in range(1, num_turns):
    msgs.append(("user", feedback_prompt(agent, partner if turn == 1 else task["target"], success)))
    msgs.append(("assistant", f"<answer>{task['target']}</answer>"))
    success = True
  return msgs


def golden_conversation_agent0(task: Mapping[str, Any]) -> list[tuple[str, str]]:
  return golden_conversation(task, 0)


def golden_conversation_agent1(task: Mapping[str, Any]) -> list[tuple[str, str]]:
  return golden_conversation(task, 1)


TEAM_REWARDS = ("all", "any")


def grade_joint_answers(
    env: Environment, threads: Sequence[Thread], target: str, source: str, team: str = "all"
):
  """(answers, success, grades) of a joint action: each agent's last <answer> (a missing
  one reported as a model_format fault of `env`), and the joint grade: 1 when every
  answer equals `target` (`team='all'`; 'any': when some answer does), with each
  agent's own hit as a component and as its local grade (`Grade.agent_scores`)."""
  answers = [extract_answer(t.last_assistant) for t in threads]
  for i, a in enumerate(answers):
    if a is None:
      env.report_fault("model_format", f"agent {i}: no <answer>...</answer>", source)
  correct = [a == target for a in answers]
  success = all(correct) if team == "all" else any(correct)
  info = {"success": float(success)}
  info.update({f"agent_{i}_correct": float(c) for i, c in enumerate(correct)})
  reason = (
      f"{'every' if team == 'all' else 'an'} agent answered the joint code"
      if success
      else f"answers {answers}; joint code {target}"
  )
  local = {i: float(c) for i, c in enumerate(correct)}
  return answers, success, {GRADE_NAME: Grade(float(success), reason, info, local)}


class CoopEnv(Environment):
  """Two agents, private halves, one joint code; the partner's answer is the feedback.

  Args:
    metadata: a `make_task` dict.
    num_turns: joint actions per episode; the env stops after the last.
    show_partner: False hides the partner's answer (the no-channel ablation).
    team_reward: 'all' (both answers right) or 'any' (one right answer scores the team).
  """

  num_agents = 2

  def __init__(
      self,
      metadata: Mapping[str, Any],
      num_turns: int = 2,
      show_partner: bool = True,
      team_reward: str = "all",
  ):
    super().__init__(metadata)
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1:
      raise ValueError(f"coop num_turns={num_turns!r}; must be an int >= 1")
    if team_reward not in TEAM_REWARDS:
      raise ValueError(f"coop team_reward={team_reward!r}; allowed: {list(TEAM_REWARDS)}")
    for key in ("parts", "target"):
      if key not in self.metadata:
        raise ValueError(f"coop task lacks {key!r}; build tasks with coop.make_task")
    self.num_turns = num_turns
    self.show_partner = bool(show_partner)
    self.team_reward = team_reward

  def initial_threads(self) -> list[Thread]:
    return [
        Thread((Turn("user", first_prompt(self.metadata, i)),), dict(self.metadata))
        for i in range(2)
    ]

  def react_to_joint(self, threads: Sequence[Thread]):
    if len(threads) != 2:
      raise ValueError(f"CoopEnv has 2 agents, got {len(threads)} threads")
    answers, success, grades = grade_joint_answers(
        self, threads, self.metadata["target"], "coop", self.team_reward
    )
    if threads[0].count("assistant") >= self.num_turns:
      return None, grades
    return [
        t.append(Turn("user", feedback_prompt(i, answers[1 - i], success, self.show_partner)))
        for i, t in enumerate(threads)
    ], grades


@register_env_factory("coop")
class CoopFactory(EnvironmentFactory):
  """Fresh `CoopEnv` per trajectory."""

  def __init__(self, num_turns: int = 2, show_partner: bool = True, team_reward: str = "all"):
    CoopEnv({"parts": ["1", "2"], "target": "12"}, num_turns, show_partner, team_reward)
    self.num_turns, self.show_partner, self.team_reward = num_turns, show_partner, team_reward

  def create_environment(self, metadata: Mapping[str, Any]) -> CoopEnv:
    return CoopEnv(metadata, self.num_turns, self.show_partner, self.team_reward)


@data.register_task_source("coop")
def coop_tasks(split: str, size: Optional[int] = None, digits: int = 2) -> data.GeneratedTasks:
  return data.GeneratedTasks(
      make_task, split, size or (100_000 if split == "train" else 200), digits=digits
  )
