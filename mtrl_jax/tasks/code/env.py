"""HumanEval code refinement with two agents (aux helper + main function), the CoMLRL setting.

`CodeRefinementEnv` (factory `humaneval`, task source `humaneval`) plays the
published multi-turn code task (docs/comlrl.md sections 1.4, 2.2, 3.1):

  turn 1   agent 0 (aux) gets `prompts.aux_prompt`, agent 1 (main)
           `prompts.main_prompt`, each as one user turn (single agent,
           num_agents=1: `prompts.single_agent_prompt`).
  reward   every joint action (aux code, main code) is scored with the gated
           level reward `rewards.execution_reward_aux` on ALL tests (single
           agent: `single_agent_reward`), then processed: raw * reward_scale +
           reward_shift (default shift -4, single agent -2.1), so rewards are
           <= 0 and the tree's termination threshold (tau -0.2 / -0.1) lives on
           the shifted scale. One Grade named 'code' carries the processed
           reward as its score and every level as a component (logged in the
           rollout dumps; `code_metrics` aggregates them).
  turn t+1 each agent gets ONE new user turn built by `mtrl_jax.tasks.code.feedback`
           in `external_mode` (level_feedback | level_passed | passed | plain |
           expert_edits | bandit), diagnostics run on `sandbox_slice` asserts.

Per-turn reward and the framework. CoMLRL scores every joint action, so the
env returns its grade at every turn: with the continuing threads at turns
< num_turns (shaping in `step_environment`) and alone at turn num_turns,
where the env stops by itself (outcome). A config must therefore weigh both
alike, `reward.outcome_weight = reward.shaping_weight = 1` with zero step and
tool penalties, and keep `env.kwargs.num_turns` equal to `tree.num_turns`
(configs/humaneval.py ties them with one FieldReference); then the reward of
every joint action is exactly the processed gated reward. Early termination by
mean sibling reward is the tree's job (`tree.termination_threshold`), not the
env's.

Prompt styles. Threads are append-only and each agent's thread already holds
its whole history, so:
  'chat'      (default, chat-native) the new user turn is only what the
              reference puts after the history: the mode block and the closing
              "Revise your ...(...)" instruction (`feedback.revision_blocks`).
  'comlrl'    the user turn is the reference's full transition string
              (`feedback.build_transition`: history + block + instruction),
              as V3 feeds it verbatim; the history then appears twice in the
              context (the thread's turns and the string).
  'comlrl_v2' as 'comlrl', wrapped again in the agent's turn-1 formatter
              (V2 without passthrough); the raw string is kept in the turn's
              metadata, and the next transition's prompt history uses it.
'bandit' re-sends the turn-1 prompt in every style; it cannot hide the
history, which stays in the thread.

Expert edits: `expert` is a callable `prompt -> str`, a `TextGenerator`
(`generate([prompt])`), or an import path 'pkg.module:name' of either (a class
is instantiated with `expert_kwargs`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Optional, Sequence

from mtrl_jax import data
from mtrl_jax.envs import (
    Environment,
    EnvironmentFactory,
    Grade,
    SharedResource,
    Thread,
    Turn,
    register_env_factory,
)
from mtrl_jax.registry import import_object
from mtrl_jax.seeds import call_seed
from mtrl_jax.tasks.code import feedback, prompts, rewards
from mtrl_jax.tasks.code.data import SPLITS, load_humaneval

PROMPT_STYLES = ("chat", "comlrl", "comlrl_v2")
GRADE_NAME = "code"


class GeneratorExpert(SharedResource):
  """Adapts a `TextGenerator` (`generate(prompts) -> list[str]`) to `prompt -> str`."""

  def __init__(self, generator):
    self.generator = generator

  def __call__(self, prompt: str, seed: Optional[int] = None) -> str:
    return self.generator.generate([prompt], seeds=None if seed is None else [seed])[0]


def seeded_expert(expert, seed: Optional[int]):
  """`expert` bound to one step's seed (`Thread.seed`): request k samples with
  `call_seed(seed, 'expert', k)` (k counts this step's requests, retries
  included), so the edits depend on the node, not on thread order. A plain
  callable expert, or no seed, is returned as it is."""
  if seed is None or not isinstance(expert, GeneratorExpert):
    return expert
  requests = itertools.count()
  return lambda prompt: expert(prompt, seed=call_seed(seed, "expert", next(requests)))


def resolve_expert(spec, kwargs: Optional[Mapping] = None):
  """The expert of `expert_edits` from a config value (None for '' / None).

  Args:
    spec: a callable `prompt -> str`, an object with `generate`, or an import
      path 'pkg.module:name' of one (a class is instantiated with `kwargs`).
    kwargs: constructor arguments when `spec` names a class.
  """
  if spec is None or spec == "":
    return None
  obj = spec
  if isinstance(spec, str):
    obj = import_object(spec, "expert")
  if isinstance(obj, type):
    obj = obj(**dict(kwargs or {}))
  if hasattr(obj, "generate"):
    return GeneratorExpert(obj)
  if callable(obj):
    return obj
  raise TypeError(f"expert={spec!r} is neither a callable prompt -> str nor a TextGenerator")


def _validate(num_agents, num_turns, external_mode, sandbox_slice, prompt_style, expert):
  if num_agents not in (1, 2):
    raise ValueError(f"humaneval num_agents={num_agents!r}; allowed: [1, 2]")
  if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1:
    raise ValueError(f"humaneval num_turns={num_turns!r}; must be an int >= 1")
  if external_mode not in feedback.MODES:
    raise ValueError(f"humaneval external_mode={external_mode!r}; allowed: {list(feedback.MODES)}")
  if prompt_style not in PROMPT_STYLES:
    raise ValueError(f"humaneval prompt_style={prompt_style!r}; allowed: {list(PROMPT_STYLES)}")
  feedback.parse_sandbox_slice(sandbox_slice)
  if external_mode == "expert_edits" and expert is None:
    raise ValueError(
        "humaneval external_mode='expert_edits' needs expert= (an import path "
        "'pkg.module:name' of a callable prompt -> str or a TextGenerator)"
    )


def _shift(num_agents: int, reward_shift: Optional[float]) -> float:
  """The reward shift; None: the reference's (-4 with two agents, -2.1 with one)."""
  if reward_shift is None:
    return rewards.MAGRPO_SHIFT if num_agents == 2 else rewards.GRPO_SHIFT
  return float(reward_shift)


class CodeRefinementEnv(Environment):
  """Aux + main agents write code; every joint action is scored; feedback drives turn t+1.

  Args:
    metadata: a HumanEval row (`prompt`, `test`, `entry_point`, ...).
    num_agents: 2 (agent 0 aux, agent 1 main) or 1 (the GRPO baseline).
    num_turns: T; the env stops after the T-th joint action.
    external_mode: the feedback mode of turns >= 2 (`feedback.MODES`).
    sandbox_slice: asserts the feedback runs (1: the first; 'all'; -n: last n).
    prompt_style: 'chat' | 'comlrl' | 'comlrl_v2' (module docstring).
    reward_shift: added to the scaled raw reward (None: -4, single agent -2.1).
    reward_scale: multiplies the raw reward first.
    expert: the expert of 'expert_edits' (`resolve_expert` output).
    timeout_per_assert_s, max_timeouts: the sandbox's per-assert alarm and cap.
  """

  def __init__(
      self,
      metadata: Mapping[str, Any],
      *,
      num_agents: int = 2,
      num_turns: int = 2,
      external_mode: str = "level_feedback",
      sandbox_slice=1,
      prompt_style: str = "chat",
      reward_shift: Optional[float] = None,
      reward_scale: float = 1.0,
      expert=None,
      timeout_per_assert_s: float = 10.0,
      max_timeouts: int = 3,
  ):
    super().__init__(metadata)
    _validate(num_agents, num_turns, external_mode, sandbox_slice, prompt_style, expert)
    missing = [k for k in ("prompt", "test", "entry_point") if k not in self.metadata]
    if missing:
      raise ValueError(f"humaneval task lacks {missing}; needs prompt, test, entry_point")
    self.num_agents = num_agents
    self.num_turns = num_turns
    self.external_mode = external_mode
    self.sandbox_slice = sandbox_slice
    self.prompt_style = prompt_style
    self.reward_shift, self.reward_scale = _shift(num_agents, reward_shift), float(reward_scale)
    self.expert = expert
    self.timeout_per_assert_s, self.max_timeouts = timeout_per_assert_s, max_timeouts

  # ------------------------------------------------------------- threads
  def initial_threads(self) -> list[Thread]:
    return [
        Thread((Turn("user", p),), dict(self.metadata))
        for p in prompts.agent_prompts(self.metadata, self.num_agents)
    ]

  def initial_thread(self) -> Thread:
    if self.num_agents != 1:
      raise ValueError(
          "CodeRefinementEnv with num_agents=2 has one thread per agent: use initial_threads()"
      )
    return self.initial_threads()[0]

  # ------------------------------------------------------------- reward
  def score(self, completions: Sequence[str]) -> Grade:
    """The processed gated reward of one joint action, every level as a component."""
    task = self.metadata
    kw = dict(timeout_per_assert_s=self.timeout_per_assert_s, max_timeouts=self.max_timeouts)
    if self.num_agents == 2:
      raw = rewards.execution_reward_aux(
          completions[0], completions[1], task["test"], task["entry_point"], task["prompt"], **kw
      )
    else:
      raw = rewards.single_agent_reward(
          completions[0], task["test"], task["entry_point"], task["prompt"], **kw
      )
    processed = rewards.process_reward(
        raw["total_reward"], scale=self.reward_scale, shift=self.reward_shift
    )
    components = {k: float(v) for k, v in raw.items()}
    components["processed_reward"] = processed
    reason = (
        f"raw {raw['total_reward']:.3f}: structure {raw['level_1_reward']:.1f}, syntax "
        f"{raw['level_2_reward']:.1f}, tests {raw['passed_tests']}/{raw['total_tests']}, "
        f"cooperation {raw['bonus_reward']:.1f}"
    )
    return Grade(processed, reason, components)

  # ------------------------------------------------------------- transitions
  def next_prompts(self, threads: Sequence[Thread], completions: Sequence[str]) -> list[Turn]:
    """The user turn each agent gets after this joint action."""
    kw = dict(timeout_per_assert_s=self.timeout_per_assert_s, max_timeouts=self.max_timeouts)
    mode = self.external_mode
    expert = seeded_expert(self.expert, threads[0].seed if threads else None)
    user_turns = [[t for t in th.turns if t.role == "user"] for th in threads]
    turn1 = [u[0].content for u in user_turns]
    meta = {"external_mode": mode}
    if self.prompt_style == "chat" or mode == "bandit":
      texts = feedback.revision_blocks(
          mode,
          self.metadata,
          completions,
          self.num_agents,
          self.sandbox_slice,
          expert,
          turn1_prompts=turn1,
          **kw,
      )
      return [Turn("user", text, metadata=meta) for text in texts]
    prompt_hist = [[t.metadata.get("external", t.content) for t in u] for u in user_turns]
    response_hist = [[t.content for t in th.turns if t.role == "assistant"] for th in threads]
    raw = feedback.build_transition(
        mode,
        self.metadata,
        completions,
        prompt_hist,
        response_hist,
        self.num_agents,
        self.sandbox_slice,
        expert,
        **kw,
    )
    if self.prompt_style == "comlrl":
      return [Turn("user", text, metadata=meta) for text in raw]
    ep = self.metadata["entry_point"]
    formatters = (
        [prompts.single_agent_prompt]
        if self.num_agents == 1
        else [prompts.aux_prompt, prompts.main_prompt]
    )
    return [
        Turn("user", fmt({"prompt": text, "entry_point": ep}), metadata={**meta, "external": text})
        for fmt, text in zip(formatters, raw)
    ]

  def react_to_joint(self, threads: Sequence[Thread]):
    if len(threads) != self.num_agents:
      raise ValueError(
          f"CodeRefinementEnv has {self.num_agents} agents, got {len(threads)} threads"
      )
    completions = [t.last_assistant for t in threads]
    grades = {GRADE_NAME: self.score(completions)}
    self._last = (tuple(completions), grades)  # what `finalize` grades if the run is cut here
    if threads[0].count("assistant") >= self.num_turns:
      return None, grades
    turns = self.next_prompts(threads, completions)
    return [th.append(turn) for th, turn in zip(threads, turns)], grades

  def finalize(self, thread):
    """A truncated trajectory is graded on the code it last wrote (an outcome of 0, the
    default, is the top of this range: a cut-off trajectory would score a full pass)."""
    threads = list(thread) if isinstance(thread, (list, tuple)) else [thread]
    completions = tuple(t.last_assistant for t in threads)
    last = getattr(self, "_last", None)
    return last[1] if last and last[0] == completions else {GRADE_NAME: self.score(completions)}

  def react_to(self, thread: Thread):
    nxt, grades = self.react_to_joint([thread])
    return (None if nxt is None else nxt[0]), grades


@register_env_factory("humaneval")
class HumanEvalFactory(EnvironmentFactory):
  """A fresh `CodeRefinementEnv` per trajectory; arguments as the env's (checked here).

  `expert` may be an import path; `expert_kwargs` are its constructor
  arguments when it names a class.
  """

  def __init__(
      self,
      num_agents: int = 2,
      num_turns: int = 2,
      external_mode: str = "level_feedback",
      sandbox_slice=1,
      prompt_style: str = "chat",
      reward_shift: Optional[float] = None,
      reward_scale: float = 1.0,
      expert=None,
      expert_kwargs: Optional[Mapping] = None,
      timeout_per_assert_s: float = 10.0,
      max_timeouts: int = 3,
  ):
    expert = resolve_expert(expert, expert_kwargs)
    _validate(num_agents, num_turns, external_mode, sandbox_slice, prompt_style, expert)
    self.kwargs = dict(
        num_agents=num_agents,
        num_turns=num_turns,
        external_mode=external_mode,
        sandbox_slice=sandbox_slice,
        prompt_style=prompt_style,
        reward_shift=reward_shift,
        reward_scale=reward_scale,
        expert=expert,
        timeout_per_assert_s=timeout_per_assert_s,
        max_timeouts=max_timeouts,
    )

  @property
  def num_agents(self) -> int:
    return self.kwargs["num_agents"]

  @property
  def outcome_range(self) -> tuple[float, float]:
    """The processed reward's range: raw levels in [0, max], scaled, then shifted."""
    k = self.kwargs
    top = rewards.MAX_REWARD if k["num_agents"] == 2 else rewards.MAX_SINGLE_AGENT_REWARD
    ends = sorted(
        rewards.process_reward(
            r, scale=k["reward_scale"], shift=_shift(k["num_agents"], k["reward_shift"])
        )
        for r in (0.0, top)
    )
    return ends[0], ends[1]

  def create_environment(self, metadata: Mapping[str, Any]) -> CodeRefinementEnv:
    return CodeRefinementEnv(metadata, **self.kwargs)


@data.register_task_source("humaneval")
def humaneval_tasks(
    split: str, limit: Optional[int] = None, max_prompt_chars: Optional[int] = None
) -> data.ListSource:
  """HumanEval problems of a split (`tasks.code.data.SPLITS`: train = test[33:163], eval =
  test[:32], train_v1 = test[33:133], test = all 164), in dataset order.

  Args:
    split: a split name.
    limit: keep the first `limit` problems (None / 0: all).
    max_prompt_chars: keep problems whose prompt has at most this many
      characters (None / 0: all); for short-context smoke runs.
  """
  if split not in SPLITS:
    raise ValueError(f"humaneval split {split!r}; allowed: {sorted(SPLITS)}")
  rows = load_humaneval(split)
  if max_prompt_chars:
    rows = [r for r in rows if len(r["prompt"]) <= max_prompt_chars]
  if limit:
    rows = rows[:limit]
  if not rows:
    raise ValueError(
        f"humaneval split {split!r} has no problem with limit={limit}, "
        f"max_prompt_chars={max_prompt_chars}"
    )
  return data.ListSource(rows)


# ------------------------------------------------------------------ metrics
def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _passes(m: Mapping) -> bool:
  return m["total_tests"] > 0 and m["passed_tests"] == m["total_tests"]


def code_metrics(
    samples_per_task: Sequence[Sequence[Mapping]], ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
  """The published evaluation metrics of the code task (reference baselines' definitions).

  Args:
    samples_per_task: per task, the reward dicts of its samples in sampling
      order (`execution_reward_aux` outputs, or the 'code' grade components).
    ks: the k of the @k metrics; a k larger than some task's sample count is
      skipped (as the reference computes only k <= num_generations).

  Returns:
    Means over tasks of `pass_or_not@k` (one of the first k samples passes
    every test), `accuracy@k` (best test pass rate among the first k),
    `max_coop@k` (best cooperation bonus among the first k, floored at 0),
    `pass@k` (the unbiased estimator over all n samples); and means over all
    samples of `structure_rate` (main defined), `syntax_rate`,
    `cooperation_rate` (bonus > 0), `full_pass_rate` and each reward level.
  """
  tasks = [list(s) for s in samples_per_task]
  if not tasks or any(not s for s in tasks):
    raise ValueError("code_metrics needs at least one task and one sample per task")
  out: dict[str, float] = {}
  n_min = min(len(s) for s in tasks)
  for k in ks:
    if k > n_min:
      continue
    first = [s[:k] for s in tasks]
    out[f"pass_or_not@{k}"] = _mean([any(_passes(m) for m in f) for f in first])
    out[f"accuracy@{k}"] = _mean(
        [
            max([m["passed_tests"] / m["total_tests"] for m in f if m["total_tests"] > 0] + [0.0])
            for f in first
        ]
    )
    out[f"max_coop@{k}"] = _mean([max([m["bonus_reward"] for m in f] + [0.0]) for f in first])
    out[f"pass@{k}"] = _mean([pass_at_k(len(s), sum(_passes(m) for m in s), k) for s in tasks])
  flat = [m for s in tasks for m in s]
  out["structure_rate"] = _mean([bool(m["main_defined"]) for m in flat])
  out["syntax_rate"] = _mean([bool(m["syntax_ok"]) for m in flat])
  out["cooperation_rate"] = _mean([m["bonus_reward"] > 0 for m in flat])
  out["full_pass_rate"] = _mean([_passes(m) for m in flat])
  for key in (
      "level_1_reward",
      "level_2_reward",
      "level_3_reward",
      "test_reward",
      "bonus_reward",
      "total_reward",
  ):
    out[f"avg_{key}"] = _mean([m[key] for m in flat])
  return out


def _mean(values) -> float:
  return float(sum(float(v) for v in values) / len(values))


def samples_from_tree(tree, turn: Optional[int] = None) -> list[list[dict]]:
  """Per root, the 'code' grade components of its joint actions at tree turn `turn`.

  Args:
    tree: a rollout `Tree` over this environment.
    turn: the tree turn (default: the last, num_turns - 1); nodes that ended
      earlier contribute nothing at later turns.

  Returns:
    One list per root (root order), each `code_metrics`-ready; masked actions
    (no grade) are left out.
  """
  turn = tree.cfg.num_turns - 1 if turn is None else turn
  roots = sorted({n.root for n in tree.nodes})
  out = {r: [] for r in roots}
  for node in tree.nodes:
    if node.turn != turn:
      continue
    for action in node.actions:
      grade = action.steps[-1].details.get("grades", {}).get(GRADE_NAME) if action else None
      if grade is not None:
        out[node.root].append(dict(grade["components"]))
  return [out[r] for r in roots]
