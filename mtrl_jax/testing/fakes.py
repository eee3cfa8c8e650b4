"""Scripted stand-ins for the parts a rollout talks to: token-level and text-free
transitions, a deterministic decode-engine stand-in (`FakePolicy`) and small text
environments with scripted rules (the index: `mtrl_jax/testing/__init__.py`)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Callable, Optional

import numpy as np

from mtrl_jax.envs import Environment, Grade, InfrastructureError, Thread, Turn
from mtrl_jax.rollout.records import ActionOutcome, StepRecord
from mtrl_jax.sampling.slots import Sample


# ---------------------------------------------------------------- token-level (benchmarks)
@dataclasses.dataclass(frozen=True)
class TokenState:
  histories: tuple  # one tuple of token ids per agent


class TokenTransition:
  """Scripted environment on token ids (see the module docstring)."""

  def __init__(self, vocab: int, obs_len: int = 8, low: int = 12):
    self.observation = tuple(range(3, 3 + obs_len))
    self.vocab, self.low = vocab, low

  def roots(
      self, num_roots: int, num_agents: int, prompt_len: int, seed: int = 0, system_len: int = 0
  ):
    """Random prompts of `prompt_len` ids after a `system_len`-token system prompt
    that every root shares (the same ids whatever the seed, like a tool schema)."""
    system = tuple(np.random.default_rng(12345).integers(self.low, self.vocab, system_len).tolist())
    rng = np.random.default_rng(seed)
    return [
        TokenState(
            tuple(
                system + tuple(rng.integers(self.low, self.vocab, prompt_len).tolist())
                for _ in range(num_agents)
            )
        )
        for _ in range(num_roots)
    ]

  def prompts(self, state: TokenState):
    return [list(h) for h in state.histories]

  def step(self, state: TokenState, actions):
    reward = float(np.mean([int(c.ids[0]) % 2 if len(c.ids) else 0 for c in actions]))
    hist = tuple(
        h + tuple(c.ids.tolist()) + self.observation for h, c in zip(state.histories, actions)
    )
    return ActionOutcome(TokenState(hist), StepRecord(reward))


# ---------------------------------------------------------------- engine tests (no text)
FEEDBACK = 7  # token the scripted environment appends after each completion
TOOL = 6  # token it appends when it asks the policy to continue (a tool result)


@dataclasses.dataclass(frozen=True)
class TokState:
  """Per-agent full histories (prompt ids), the root index, turn and sub-step."""

  root: int
  turn: int
  histories: tuple
  sub: int = 0  # tool continuations so far within this turn


class ScriptedTransition:
  """Appends each agent's completion and a feedback token to its own history.

  reward(state, actions) -> float decides r; stop(state, actions) -> bool ends
  the episode on that action; fault(state, actions) -> bool marks an
  infrastructure fault; continues(state, actions) -> bool answers with a
  tool token and waits for the policy (`continues_turn`); sleep_s simulates a
  slow tool.
  """

  def __init__(
      self,
      reward: Optional[Callable] = None,
      stop: Optional[Callable] = None,
      fault: Optional[Callable] = None,
      sleep_s: float = 0.0,
      continues: Optional[Callable] = None,
  ):
    self.reward = reward or (lambda s, a: float(sum(int(c.ids.sum()) for c in a) % 5) / 4)
    self.stop = stop or (lambda s, a: False)
    self.fault = fault or (lambda s, a: False)
    self.continues = continues or (lambda s, a: False)
    self.sleep_s = sleep_s

  @staticmethod
  def roots(num_roots: int, num_agents: int) -> list:
    return [
        TokState(r, 0, tuple((3, 10 + r, 20 + i) for i in range(num_agents)))
        for r in range(num_roots)
    ]

  def prompts(self, state):
    return [list(h) for h in state.histories]

  def step(self, state, actions):
    if self.sleep_s:
      time.sleep(self.sleep_s)
    r = self.reward(state, actions)
    if self.fault(state, actions):
      return ActionOutcome(None, StepRecord(0.0, valid=False, details={"fault": "infrastructure"}))
    if self.stop(state, actions):
      return ActionOutcome(None, StepRecord(r, details={"stopped": True}))
    if self.continues(state, actions):
      hist = tuple(
          h + tuple(int(t) for t in c.ids) + (TOOL,) for h, c in zip(state.histories, actions)
      )
      return ActionOutcome(
          TokState(state.root, state.turn, hist, state.sub + 1),
          StepRecord(r, continues_turn=True, details={"r": r, "tool": True}),
      )
    hist = tuple(
        h + tuple(int(t) for t in c.ids) + (FEEDBACK,) for h, c in zip(state.histories, actions)
    )
    return ActionOutcome(
        TokState(state.root, state.turn + 1, hist), StepRecord(r, details={"r": r})
    )


class _FakeHandle:
  __slots__ = ("ids", "released")

  def __init__(self, ids):
    self.ids, self.released = ids, False


class FakePolicy:
  """Deterministic stand-in for the decode engine (a `rollout.policy.RolloutPolicy`).

  Sample g of a request draws its length and tokens from a numpy generator
  seeded by a hash of (prompt, agent, key, rows[g]), so samples do not depend
  on batching, slots or timing, and two runs with the same key agree bit for
  bit. Scripted policies override `completion(req, g)`. Each sample
  finishes after a random number of steps (from `latency_seed`; 0 steps when
  `max_latency` is 0), so the order in which samples come back changes with
  the latency seed while the samples do not.

  Counters: `requests` (every request, in submission order), `reused` (prompt
  tokens a named parent's cache held: the prompt extends it), `misses`
  (requests whose parent's cache was not a prefix of the prompt), `released`.

  Args:
    vocab: token ids are drawn from [low, vocab).
    max_new_tokens: longest completion.
    stop_id: appended to completions that finish with 'stop'; None: never stop.
    low: smallest token id drawn (keeps special tokens out of the body).
    stop_prob: probability that a completion ends with the stop token.
    separate: one parameter set per agent (how the engine names keys).
    max_latency: most engine steps a request takes.
    latency_seed: seed of the latencies.
  """

  def __init__(
      self,
      vocab: int = 256,
      max_new_tokens: int = 8,
      stop_id: Optional[int] = None,
      low: int = 1,
      stop_prob: float = 0.8,
      separate: bool = False,
      max_latency: int = 0,
      latency_seed: int = 0,
  ):
    if not 0 <= low < vocab:
      raise ValueError(f"FakePolicy low={low} must be in [0, vocab={vocab})")
    self.vocab, self.low = vocab, low
    self.max_new_tokens = max_new_tokens
    self.stop_id, self.stop_prob = stop_id, stop_prob
    self.separate = separate
    self.max_latency = max_latency
    self._latency = np.random.default_rng(latency_seed)
    self.requests: list = []
    self.reused = self.misses = self.released = 0
    self._pending: list = []  # [steps left, request]

  def completion(self, req, g: int):
    """(ids int32, logprobs float32, finish reason) of sample g of request `req`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(req.key, np.uint32).tobytes())
    h.update(np.asarray([req.agent, int(np.asarray(req.rows).reshape(-1)[g])], np.int64).tobytes())
    h.update(np.asarray(req.prompt, np.int64).tobytes())
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    n = int(rng.integers(1, self.max_new_tokens + 1))
    ids = rng.integers(self.low, self.vocab, size=n).astype(np.int32)
    stop = self.stop_id is not None and rng.random() < self.stop_prob
    if stop:
      ids[-1] = self.stop_id
    logprobs = -rng.exponential(1.0, size=n).astype(np.float32)
    return ids, logprobs, "stop" if stop else "length"

  def start(self, fanout: int) -> None:
    del fanout

  def submit(self, req) -> None:
    prompt = np.asarray(req.prompt, np.int64)
    if req.parent is not None:
      cached = req.parent.ids
      if len(cached) <= len(prompt) and np.array_equal(prompt[: len(cached)], cached):
        self.reused += len(cached)
      else:
        self.misses += 1
    self.requests.append(req)
    for g in range(np.asarray(req.rows).size):
      wait = int(self._latency.integers(0, self.max_latency + 1)) if self.max_latency else 0
      self._pending.append([wait, req, g])

  def step(self, expect_more: bool = False):
    done, still = [], []
    for item in self._pending:
      if item[0] > 0:
        item[0] -= 1
        still.append(item)
        continue
      _, req, g = item
      ids, logprobs, reason = self.completion(req, g)
      cached = np.concatenate([np.asarray(req.prompt, np.int64), ids[:-1]])
      done.append(Sample(req.tag, g, ids, logprobs, reason, _FakeHandle(cached)))
    self._pending = still
    return done, bool(still or expect_more)

  def release(self, handle) -> None:
    handle.released = True
    self.released += 1

  @property
  def busy(self) -> bool:
    return bool(self._pending)

  def finish(self) -> dict:
    return {}


def total_ids(actions) -> int:
  return int(np.sum([c.ids.sum() for c in actions]))


# ---------------------------------------------------------------- text environments
CLOSED = []  # closed environments (fork count checks); the objects, not their ids,
# which Python reuses once an object is freed
_CLOSED_LOCK = threading.Lock()


class DuoEnv(Environment):
  """Two agents: r = fraction of agents whose message has an even length.

  Keeps a step counter in an attribute (per-branch state, forked at every
  step), replies with one feedback user turn per agent, stops when both
  messages are shorter than `stop_below` characters, and raises an
  infrastructure error when agent 0's message has length `broken_len`.
  """

  num_agents = 2

  def __init__(self, metadata=None, stop_below=0, broken_len=-1):
    super().__init__(metadata)
    self.steps = 0
    self.stop_below = stop_below
    self.broken_len = broken_len

  def initial_threads(self):
    task = self.metadata["prompt"]
    return [self._thread(f"You are agent {i}. Task: {task}") for i in range(2)]

  def _thread(self, text):
    return Thread((Turn("user", text),), dict(self.metadata))

  def react_to_joint(self, threads):
    texts = [t.last_assistant for t in threads]
    if len(texts[0]) == self.broken_len:
      raise InfrastructureError("scripted outage")
    self.steps += 1
    score = sum(len(t) % 2 == 0 for t in texts) / 2
    grade = Grade(score, "even lengths", {"steps": self.steps})
    if all(len(t) < self.stop_below for t in texts):
      return None, grade
    replies = [
        t.append(Turn("user", f"step {self.steps}: agent {i} wrote {len(texts[i])}"))
        for i, t in enumerate(threads)
    ]
    return replies, {"even": grade}

  def close(self):
    with _CLOSED_LOCK:
      CLOSED.append(self)


class SoloEnv(Environment):
  """One agent: r = 1 when the message has an even length; always continues."""

  def react_to(self, thread):
    score = float(len(thread.last_assistant) % 2 == 0)
    return thread.append(Turn("user", "again")), Grade(score)


class ToolThenUserEnv(Environment):
  """One agent: a message right after a user turn gets a tool turn (its length),
  the message after the tool result gets the user's next question; never stops.

  r = 1 when the message after the tool result repeats the tool's text.
  """

  def initial_thread(self):
    return Thread((Turn("user", self.metadata["prompt"]),), dict(self.metadata))

  def react_to(self, thread):
    text = thread.last_assistant
    if thread.turns[-2].role == "user":
      return thread.append(Turn("tool", str(len(text)))), None
    return thread.append(Turn("user", "next")), Grade(float(thread.turns[-2].content in text))

  def close(self):
    with _CLOSED_LOCK:
      CLOSED.append(self)
