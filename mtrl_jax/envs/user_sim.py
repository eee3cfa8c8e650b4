"""User simulators: where the next user message comes from.

`ScriptedUserSimulator` replays fixed messages; `LLMUserSimulator` asks a
local model (any `TextGenerator`, e.g. `mtrl_jax.sampling.generation.LocalLLM`)
to play a user with a persona and a goal, and to write a done marker when the
goal is met. The simulator is not trained: its messages become `user` turns,
which the renderer never marks trainable, so they carry no loss.

    reply = sim.reply(thread)           # UserReply(text, done)
    if reply.done: return None, grades
    return thread.append(Turn("user", reply.text)), None
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Sequence

from mtrl_jax.envs.core import Thread
from mtrl_jax.envs.faults import InfrastructureError
from mtrl_jax.resources import SharedResource
from mtrl_jax.seeds import call_seed

DEFAULT_PROMPT = (
    "You are role-playing a USER talking to an AI ASSISTANT.\n"
    "Persona: {persona}\n"
    "Your goal: {goal}\n\n"
    "Conversation so far:\n{transcript}\n\n"
    "Write the USER's next message only. If your goal has been met, or the assistant "
    "cannot help, write {done_marker} instead."
)


@dataclasses.dataclass(frozen=True)
class UserReply:
  """The simulator's next message; `done` ends the conversation (text may be empty)."""

  text: str
  done: bool


class ScriptedUserSimulator:
  """Replies with fixed messages in order; done when they run out.

  Holds its position, so an environment that forks copies it with the
  environment (each branch continues the script from where it was).
  """

  fault_source = "user_sim"  # faults raised inside are the user simulator's (`fault_source`)

  def __init__(self, messages: Sequence[str]):
    self.messages = list(messages)
    self.position = 0

  def reply(self, thread: Thread) -> UserReply:
    del thread
    if self.position >= len(self.messages):
      return UserReply("", True)
    self.position += 1
    return UserReply(self.messages[self.position - 1], False)

  def reply_batch(self, threads: Sequence[Thread]) -> list[UserReply]:
    return [self.reply(t) for t in threads]


def _transcript(thread: Thread) -> str:
  lines = []
  for t in thread.turns:
    if t.role in ("user", "assistant"):
      lines.append(f"{t.role.upper()}: {t.content}")
  return "\n".join(lines) or "(empty)"


class LLMUserSimulator(SharedResource):
  """A local model playing the user.

  Stateless across conversations (the persona and goal are fixed; the
  conversation comes from the thread), so forks share it. Each reply samples
  with `call_seed(thread.seed, 'user_sim')` when the framework set the
  thread's seed (every rollout step does), so it depends on the node it
  answers, never on which thread called first.

  Args:
    generator: a `TextGenerator` (`generate(prompts, sampling) -> list[str]`).
    persona: who the user is.
    goal: what the user wants; the simulator stops once it is met.
    done_marker: the text that ends the conversation.
    template: prompt with {persona}, {goal}, {transcript}, {done_marker}.
    sampling: passed to the generator (e.g. a `SamplingConfig`).
    max_chars: longer messages are cut (keeps the token budget bounded).
  """

  fault_source = "user_sim"

  def __init__(
      self,
      generator,
      persona: str,
      goal: str,
      *,
      done_marker: str = "[DONE]",
      template: str = DEFAULT_PROMPT,
      sampling: Any = None,
      max_chars: Optional[int] = 2000,
  ):
    if not hasattr(generator, "generate"):
      raise TypeError(f"LLMUserSimulator: generator {generator!r} has no generate()")
    if not done_marker:
      raise ValueError("LLMUserSimulator: done_marker must not be empty")
    for key in ("{transcript}", "{done_marker}"):
      if key not in template:
        raise ValueError(f"LLMUserSimulator: template lacks {key}")
    self.generator = generator
    self.persona, self.goal = persona, goal
    self.done_marker = done_marker
    self.template = template
    self.sampling = sampling
    self.max_chars = max_chars
    self._lock = threading.Lock()
    self.turns_generated = 0
    self.conversations_done = 0

  def prompt(self, thread: Thread) -> str:
    return self.template.format(
        persona=self.persona,
        goal=self.goal,
        transcript=_transcript(thread),
        done_marker=self.done_marker,
    )

  def _parse(self, text: str) -> UserReply:
    text = text.strip()
    if self.done_marker in text:
      return UserReply(text.split(self.done_marker, 1)[0].strip(), True)
    if not text:
      raise InfrastructureError(
          f"user simulator produced an empty message without {self.done_marker!r}"
      )
    if self.max_chars is not None:
      text = text[: self.max_chars]
    return UserReply(text, False)

  def reply_batch(self, threads: Sequence[Thread]) -> list[UserReply]:
    """Next user message of each thread, in one generator call."""
    if not threads:
      return []
    seeds = [None if t.seed is None else call_seed(t.seed, "user_sim") for t in threads]
    kw = {} if any(s is None for s in seeds) else {"seeds": seeds}
    try:
      texts = self.generator.generate([self.prompt(t) for t in threads], self.sampling, **kw)
    except Exception as e:  # the simulator is infrastructure, never the policy's fault
      raise InfrastructureError(f"user simulator failed: {type(e).__name__}: {e}") from e
    if len(texts) != len(threads):
      raise InfrastructureError(
          f"user simulator returned {len(texts)} messages for {len(threads)} threads"
      )
    replies = [self._parse(t) for t in texts]
    with self._lock:
      self.turns_generated += sum(not r.done for r in replies)
      self.conversations_done += sum(r.done for r in replies)
    return replies

  def reply(self, thread: Thread) -> UserReply:
    return self.reply_batch([thread])[0]
