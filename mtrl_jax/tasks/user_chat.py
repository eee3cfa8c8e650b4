"""A conversation with a simulated user, graded by an LLM judge.

The first user message is the task's; after every policy reply an
`LLMUserSimulator` (persona + the task's goal) writes the next user message
or its done marker, and when the conversation ends (done marker, or
`user_turns` user messages) a `BinaryJudgeGrader` grades the whole
conversation: the outcome is P(PASS). Both run on one local model served by a
`LocalLLM` (behind a `BatchingGenerator`, so concurrent environments share
model calls): a preset built from a seed (`preset='tiny'`: a random model,
for tests and timing) or a local HF-format checkpoint (`model_path`).

Every model call is seeded by the node it answers (`Thread.seed`), so the
same step gives the same conversations and grades with any number of
environment threads, and a resumed run replays them.

  --config.env.factory=user_chat --config.tasks.source=user_chat
"""

from __future__ import annotations

from typing import Optional

from mtrl_jax import data
from mtrl_jax.envs import (
    Environment,
    EnvironmentFactory,
    LLMUserSimulator,
    SharedResource,
    Turn,
    register_env_factory,
)
from mtrl_jax.graders import BinaryJudgeGrader

TOPICS = (
    "the weather in Paris",
    "a pasta recipe",
    "how tides work",
    "a name for a cat",
    "the boiling point of water",
    "a short poem about trees",
    "how to tie a knot",
    "the capital of Peru",
)
PERSONA = "a curious person who writes short messages"
CRITERIA = "The assistant answered the user's question helpfully and politely."


# Policy-tokenizer specials of a thinking model (`tokenizer.extra_specials`).
THINK_SPECIALS = ("<think>", "</think>")


def thinking_conversation(task) -> list[tuple[str, str]]:
  """A golden conversation in a thinking model's format (`sft.conversations`): every
  assistant turn opens with a `<think>` block, which a Qwen3-style template
  (`tokenizer.strip_thinking`) hides once the next user turn arrives."""
  return [
      ("user", task["prompt"]),
      ("assistant", "<think>ok</think>Sure."),
      ("user", "Thanks, and more?"),
      ("assistant", "<think>hm</think>More."),
  ]


def make_task(split: str, index: int) -> dict:
  """Task `index` of `split`: a topic the user asks about (a pure function of both)."""
  if split not in ("train", "eval", "test"):
    raise ValueError(f"user_chat split={split!r}; allowed: ['train', 'eval', 'test']")
  offset = {"train": 0, "eval": 3, "test": 5}[split]
  topic = TOPICS[(index + offset) % len(TOPICS)]
  return {"prompt": f"Tell me about {topic}.", "goal": f"learn about {topic}", "topic": topic}


@data.register_task_source("user_chat")
def user_chat_tasks(split: str, size: Optional[int] = None) -> data.GeneratedTasks:
  """`size` tasks of a split (default: 1000 train, 16 eval/test)."""
  return data.GeneratedTasks(make_task, split, size or (1000 if split == "train" else 16))


class UserChatEnv(Environment):
  """One conversation: the simulator answers until done, then the judge grades."""

  def __init__(
      self, metadata, simulator: LLMUserSimulator, judge: BinaryJudgeGrader, user_turns: int
  ):
    super().__init__(metadata)
    self.simulator, self.judge, self.user_turns = simulator, judge, user_turns

  def react_to(self, thread):
    if thread.count("user") < self.user_turns:
      reply = self.simulator.reply(thread)
      if not reply.done:
        return thread.append(Turn("user", reply.text)), None
    return None, {"judge": self.judge.grade(thread)}


class _SharedModel(SharedResource):
  """The local model behind the simulator and the judge, built once per factory."""

  def __init__(
      self,
      preset: str,
      model_path: str,
      seed: int,
      max_new_tokens: int,
      temperature: float,
      batch_wait_s: float,
  ):
    from mtrl_jax import models, text  # model code only when a factory is built
    from mtrl_jax.sampling import SamplingConfig
    from mtrl_jax.sampling.batching import BatchingGenerator
    from mtrl_jax.sampling.generation import LocalLLM

    if model_path:
      from mtrl_jax.models.loading import from_pretrained

      model = from_pretrained(model_path)
      tokenizer = text.HFTokenizer.from_dir(model_path)
    else:
      tokenizer = text.ByteTokenizer()
      # Exactly the tokenizer's vocabulary: every sampled id decodes.
      cfg = models.get_preset(preset).replace(vocab_size=tokenizer.vocab_size)
      model = models.create_model(cfg, seed=seed)
    # fixed_rows: a reply or score never depends on what shares its batch.
    self.llm = LocalLLM(
        model,
        tokenizer,
        seed=seed,
        fixed_rows=4,
        sampling=SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
    )
    self.generator = BatchingGenerator(self.llm, max_wait_s=batch_wait_s)


@register_env_factory("user_chat")
class UserChatFactory(EnvironmentFactory):
  """Environments whose user is a local model and whose outcome an LLM judge gives.

  Args:
    preset: model preset of the simulator / judge when `model_path` is empty.
    model_path: a local HF-format checkpoint for both (its tokenizer too).
    seed: the preset model's init seed and the generator's base key.
    user_turns: user messages per conversation (the task's included).
    max_new_tokens: longest simulated user message, in tokens.
    temperature: sampling temperature of the simulated user.
    persona: who the simulated user is.
    criteria: what the judge's PASS means.
    batch_wait_s: how long a model call waits for concurrent ones to join.
  """

  outcome_range = (0.0, 1.0)
  num_agents = 1

  def __init__(
      self,
      preset: str = "tiny",
      model_path: str = "",
      seed: int = 0,
      user_turns: int = 2,
      max_new_tokens: int = 16,
      temperature: float = 1.0,
      persona: str = PERSONA,
      criteria: str = CRITERIA,
      batch_wait_s: float = 0.002,
  ):
    if user_turns < 1:
      raise ValueError(f"user_chat user_turns={user_turns}; allowed: an int >= 1")
    self.model = _SharedModel(preset, model_path, seed, max_new_tokens, temperature, batch_wait_s)
    self.user_turns, self.persona = user_turns, persona
    self.judge = BinaryJudgeGrader(self.model.generator, criteria, name="judge")

  def create_environment(self, metadata) -> UserChatEnv:
    simulator = LLMUserSimulator(
        self.model.generator, self.persona, metadata["goal"], max_chars=200
    )
    return UserChatEnv(metadata, simulator, self.judge, self.user_turns)
