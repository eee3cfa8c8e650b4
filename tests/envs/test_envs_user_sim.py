"""User simulators: scripted and LLM-backed; their turns are never trainable."""

import pytest

from mtrl_jax.envs import (
    Environment,
    FaultKind,
    InfrastructureError,
    LLMUserSimulator,
    ScriptedUserSimulator,
    Thread,
    Turn,
    rollout_scripted,
)
from mtrl_jax.graders import ScriptedGenerator


class _Chat(Environment):
  """Continues while the simulated user has something to say."""

  def __init__(self, sim):
    super().__init__({"prompt": "hello"})
    self.sim = sim

  def react_to(self, thread):
    reply = self.sim.reply(thread)
    if reply.done:
      return None, {"turns": 1.0 / thread.count("assistant")}
    return thread.append(Turn("user", reply.text)), None


def test_scripted_user_simulator_conversation():
  outs, seen = rollout_scripted(_Chat(ScriptedUserSimulator(["what?", "ok"])), ["a", "b", "c", "d"])
  assert len(outs) == 3 and outs[-1].done
  assert [t.content for t in seen[-1].turns if t.role == "user"] == ["hello", "what?", "ok"]
  assert outs[-1].grades["turns"].score == pytest.approx(1 / 3)


def test_llm_user_simulator_prompt_done_marker_and_masking(renderer):
  gen = ScriptedGenerator(replies=["  Which city?  ", "Thanks! [DONE] extra"])
  sim = LLMUserSimulator(gen, persona="a tourist", goal="know the weather in Oslo")
  outs, seen = rollout_scripted(_Chat(sim), ["Hi!", "Oslo is 4C."], renderer=renderer)
  assert outs[-1].done and len(outs) == 2
  user_turn = outs[0].next_thread.turns[-1]
  assert user_turn.role == "user" and user_turn.content == "Which city?"
  prompt = gen.prompts[0]
  assert "Persona: a tourist" in prompt and "Your goal: know the weather in Oslo" in prompt
  assert "USER: hello\nASSISTANT: Hi!" in prompt and "[DONE]" in prompt
  assert (sim.turns_generated, sim.conversations_done) == (1, 1)
  # Simulated user tokens are in the ledger as user turns and never trainable.
  ledger = seen[-1].ledger
  user_pos = [i for i, r in enumerate(ledger.roles) if r == "user"]
  assert len(user_pos) > len("hello") + len("Which city?")
  assert not any(ledger.trainable[i] for i in user_pos)
  assert renderer.tokenizer.decode([ledger.ids[i] for i in user_pos]).count("Which city?") == 1


def test_llm_user_simulator_batch_and_failures():
  gen = ScriptedGenerator(replies=lambda p: "[DONE]" if "bye" in p else "more")
  sim = LLMUserSimulator(gen, "p", "g")
  threads = [
      Thread.from_messages([("assistant", "bye")]),
      Thread.from_messages([("assistant", "hi")]),
  ]
  replies = sim.reply_batch(threads)
  assert [(r.text, r.done) for r in replies] == [("", True), ("more", False)]
  assert gen.calls == 1
  with pytest.raises(InfrastructureError, match="empty message"):
    LLMUserSimulator(ScriptedGenerator(replies=["  "]), "p", "g").reply(threads[0])

  def crash(prompt):
    raise RuntimeError("device lost")

  env = _Chat(LLMUserSimulator(ScriptedGenerator(replies=crash), "p", "g"))
  outs, _ = rollout_scripted(env, ["a"])
  assert outs[0].masked and outs[0].faults[0].kind == FaultKind.INFRASTRUCTURE
  assert outs[0].faults[0].source == "user_sim" and "device lost" in outs[0].faults[0].message


def test_llm_user_simulator_is_shared_by_forks():
  sim = LLMUserSimulator(ScriptedGenerator(replies=["x"]), "p", "g")
  env = _Chat(sim)
  assert env.fork().sim is sim
  scripted = _Chat(ScriptedUserSimulator(["1", "2"]))
  scripted.sim.reply(None)
  child = scripted.fork()
  assert child.sim is not scripted.sim and child.sim.position == 1
