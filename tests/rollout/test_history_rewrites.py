"""History rewrites: a Qwen3-style template strips earlier thinking.

Once a new user turn arrives, the policy's earlier `<think>...</think>` is no
longer shown, so the next context does not extend the sampled tokens. The
rollout renders the rewritten history into a new ledger and trains the next
action on it; earlier actions keep their own tokens, logprobs and advantages,
in both batch layouts.
"""

import jax
import numpy as np
import pytest

from mtrl_jax.envs import Environment, Grade, Turn
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.batching import BatchConfig, make_train_batch
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.text import ChatRenderer, compact, strip_thinking
from mtrl_jax.testing import FakePolicy, byte_tokenizer

LOGP = -0.5


def test_context_view_strips_thinking_before_the_last_user_turn_only():
  r = ChatRenderer(byte_tokenizer(), compact(byte_tokenizer()), strip_thinking=True)
  turns = [
      ("user", "q1"),
      ("assistant", "<think>a</think>\nA1"),
      ("user", "q2"),
      ("assistant", "<think>b</think>A2"),
  ]
  assert r.context_view(turns) == [
      ("user", "q1"),
      ("assistant", "A1"),
      ("user", "q2"),
      ("assistant", "<think>b</think>A2"),
  ]
  plain = ChatRenderer(byte_tokenizer(), compact(byte_tokenizer()))
  assert plain.context_view(turns) == turns
  assert strip_thinking("no thinking") == "no thinking"
  assert strip_thinking("<think>x</think>y</think>\n\nz") == "z"
  with pytest.raises(ValueError, match="strip_thinking"):
    ChatRenderer(byte_tokenizer(), compact(byte_tokenizer()), strip_thinking="yes")


class AskTwice(Environment):
  """Two user turns; the outcome rewards a longer final answer (advantages differ)."""

  def react_to(self, thread):
    if thread.count("user") < 2:
      return thread.append(Turn("user", "and then?")), None
    return None, Grade(len(strip_thinking(thread.last_assistant)) / 10.0)


class ThinkingPolicy(FakePolicy):
  """Sample g of every prompt: '<think>plan g</think>' then an answer of g + 1 letters."""

  def __init__(self, renderer):
    super().__init__()
    self.renderer = renderer

  def completion(self, req, g):
    ids = self.renderer.tokenizer.encode(f"<think>plan {g}</think>" + "x" * (g + 1)) + [
        self.renderer.fmt.stop_ids[0]
    ]
    return np.asarray(ids, np.int32), np.full(len(ids), LOGP, np.float32), "stop"


@pytest.mark.parametrize("packing", ["tree", "rows"])
def test_rewritten_history_starts_a_new_segment_and_keeps_earlier_actions(packing):
  tok = byte_tokenizer()
  renderer = ChatRenderer(tok, compact(tok), strip_thinking=True)
  transition = EnvTransition(renderer)
  roots = [transition.root_state(AskTwice({"prompt": p})) for p in ("hi", "yo")]
  cfg = TreeConfig(num_turns=2, num_generations=2)
  tree = expand_tree(cfg, ThinkingPolicy(renderer), transition, roots, jax.random.key(0))
  children = [n for n in tree.nodes if n.turn == 1]
  assert len(children) == 4 and not any((~n.valid_B).any() for n in tree.nodes)
  for child in children:
    parent = tree.nodes[child.parent_id]
    comp = parent.completions[0][child.parent_action]
    assert parent.actions[child.parent_action].steps[-1].details["history_rewrites"] == 1
    sampled = parent.prompts[0] + comp.ids.tolist()
    assert child.prompts[0][: len(sampled)] != sampled  # not an extension: a new segment
    text = tok.decode(child.prompts[0])
    assert "<think>" not in text and "and then?" in text  # the template's view
  assert renderer.metrics()["text/history_rewrites"] == 4

  batch, m = make_train_batch(
      tree, BatchConfig(packing=packing, length_buckets=(128,), zero_variance_filter=False)
  )
  actions = [(n, g) for n in tree.nodes for g in range(2)]
  assert m["batch/actions"] == len(actions)
  lengths = [len(n.completions[0][g].ids) for n, g in actions]
  mask = batch.loss_mask_BxK
  assert mask.sum() == sum(lengths)  # every action trains on all of its own sampled tokens
  np.testing.assert_array_equal(batch.old_logp_BxK[mask], LOGP)
  adv = batch.adv_BxK[mask]
  expected = np.concatenate(
      [np.full(n_tok, n.advantages_NxG[0, g]) for (n, g), n_tok in zip(actions, lengths)]
  )
  np.testing.assert_allclose(np.sort(adv), np.sort(expected), rtol=1e-6)
  assert np.abs(expected).max() > 0  # the turn-0 actions' own advantages are trained
