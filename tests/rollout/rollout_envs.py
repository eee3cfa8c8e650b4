"""Small text environments for the rollout tests (scripted rules, no model)."""

import threading

from mtrl_jax.envs import Environment, InfrastructureError, Turn
from mtrl_jax.graders import Grade

CLOSED = []  # ids of closed environments (fork count checks)
_LOCK = threading.Lock()


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
    from mtrl_jax.envs import Thread
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
    replies = [t.append(Turn("user", f"step {self.steps}: agent {i} wrote {len(texts[i])}"))
               for i, t in enumerate(threads)]
    return replies, {"even": grade}

  def close(self):
    with _LOCK:
      CLOSED.append(id(self))


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
    from mtrl_jax.envs import Thread
    return Thread((Turn("user", self.metadata["prompt"]),), dict(self.metadata))

  def react_to(self, thread):
    text = thread.last_assistant
    if thread.turns[-2].role == "user":
      return thread.append(Turn("tool", str(len(text)))), None
    return thread.append(Turn("user", "next")), Grade(float(thread.turns[-2].content in text))

  def close(self):
    with _LOCK:
      CLOSED.append(id(self))
