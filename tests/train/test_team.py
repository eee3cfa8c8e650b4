"""A team of agents of different architectures (`run.groups`, `train.team`).

- Grouping: agents of one architecture and tokenizer share a group; a team
  is any run whose agents are not all the top-level model.
- Equality with the plain layout: a team of one architecture split into one
  group per agent samples the same tree and makes the same update as the same
  agents stacked in one program.
- The real loop: a team of a 2-layer d32 preset and a d128 checkpoint with a
  larger vocabulary trains, resumes exactly and exports one directory per
  agent, each with its own architecture.
- Refusals: what a team cannot do is named in one line before any compute.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import coop as coop_config
from mtrl_jax import models, testing
from mtrl_jax.models import loading
from mtrl_jax.rollout import expand_tree
from mtrl_jax.rollout.dump import node_records
from mtrl_jax.rollout.policy import TeamPolicy
from mtrl_jax.run import components, experiment, groups, saved, warmup
from mtrl_jax.run.evaluate import indexed
from mtrl_jax.train.team import TeamPolicies, TeamState
from tests.train.test_separate_policies import _rows, run_on_one_device


def _team_config(steps: int = 2, path: str = ""):
  """The coop smoke run with one policy per agent and no warm-up (a team cannot share
  one); agent 1 is `path`'s checkpoint when given."""
  c = coop_config.get_config("smoke=True")
  c.agents.share_policy = False
  c.agents.learning_rates = (1e-3, 3e-3)
  c.sft.steps = 0
  c.rl.steps = steps
  c.tree.advantage_mode = "raw"  # the smoke policies' sibling groups are often all-equal
  c.reward.step_penalty = -0.05  # a non-zero return even when the smoke policy fails
  c.loss.kl_coef = 0.01  # each agent's reference is its own
  c.rl.updates_per_step = 2  # each agent's clipped ratio reads its own old logprobs
  c.rl.dump_every = 0
  c.eval.every = 1
  c.checkpoint.every = 1  # the step-1 checkpoint a resumed run starts from
  if path:
    c.agents.paths = ("", path)
  return c


def test_agents_of_one_architecture_and_tokenizer_share_a_group():
  c = _team_config()
  c.agents.presets = ("", "small")
  exp = experiment.validate(c)
  assert groups.is_team(exp)
  got = [(g.agents, g.arch.d_model) for g in exp.agents.team]
  assert got == [((0,), exp.model.arch.d_model), ((1,), 128)]
  # The preset keeps the run's (fitted) vocabulary: the byte tokenizer is every agent's.
  assert exp.agents.team[1].arch.vocab_size == exp.model.arch.vocab_size
  assert exp.agents.team == groups.team_groups(exp)
  c.agents.presets = ("small", "small")  # one group, but not the top-level model
  exp = experiment.validate(c)
  assert groups.is_team(exp) and [g.agents for g in exp.agents.team] == [(0, 1)]
  c.agents.presets = ("tiny", "")  # the smoke config's own architecture: stacked as ever
  assert not groups.is_team(experiment.validate(c))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("critic.kind", "independent", r"critic.kind='independent' with agents of another"),
    ],
)
def test_what_a_team_cannot_do_is_refused_in_one_line(field, value, match):
  c = _team_config()
  c.agents.presets = ("", "small")
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(experiment.ConfigError, match=match):
    experiment.validate(c)


def _one_step(parts, key):
  """One rollout of 2 train tasks and one update from the parts' first state (after the
  warm-up, if any): (tree records, train metrics, every agent's parameters after the
  update, (the batch, its metrics))."""
  exp, policies = parts.exp, parts.policies
  state = warmup.warm_up(parts)[0] if exp.sft.steps else policies.init_state()
  ref = policies.train_step.copy_params(state.params)
  parts.rollout_policy.set_states(policies.sampler_states(state.params))
  roots = parts.transition.root_states(parts.factory, indexed(parts.train_tasks, 2))
  tree = expand_tree(exp.tree, parts.rollout_policy, parts.transition, roots, key)
  batch, batch_metrics = policies.make_batch(tree, parts.batch_cfg)
  batch = policies.train_step.old_logprobs(state.params, batch)
  state, dm = policies.train_step(state, ref, batch)
  params = [nnx.to_pure_dict(p) for p in policies.per_policy(state.params)]
  return node_records(tree), policies.train_metrics(dm), params, (batch, batch_metrics)


@pytest.mark.slow  # two builds, warm-ups and updates, compared
def test_a_team_of_one_architecture_in_one_group_per_agent_equals_the_stacked_agents():
  """Warm-up (each group warms its own start: here the same model on the same rows),
  rollout and update."""
  c = _team_config()
  c.sft.steps, c.sft.check_every = 2, 2
  exp = experiment.validate(c)
  assert not groups.is_team(exp)
  key = jax.random.PRNGKey(3)
  stacked = _one_step(components.build(exp), key)
  split = tuple(groups.AgentGroup((a,), exp.model.arch, "") for a in range(2))
  parts = components.build(
      dataclasses.replace(exp, agents=dataclasses.replace(exp.agents, team=split))
  )
  assert isinstance(parts.policies, TeamPolicies)
  assert isinstance(parts.rollout_policy, TeamPolicy) and len(parts.engines) == 2
  team = _one_step(parts, key)
  assert team[0] == stacked[0]  # the same tokens, rewards and advantages
  assert set(team[1]) == set(stacked[1])
  for k, v in stacked[1].items():
    assert team[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
  # The updates agree to float32 rounding: each group pads its rows to its own length,
  # so sums run in another order (Adam's steps are ~1e-3 here; rounding moves ~1e-6).
  for a in range(2):
    for x, y in zip(jax.tree.leaves(team[2][a]), jax.tree.leaves(stacked[2][a])):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)
  # The team's padding is over every group's padded token slots (each agent trains).
  batches, m = team[3]
  assert m["batch/tokens_trained"] == stacked[3][1]["batch/tokens_trained"]
  slots = sum(b.tokens_BxL.size for b in batches if b is not None)
  assert m["batch/padding_fraction"] == 1.0 - m["batch/tokens_trained"] / slots


def test_a_team_of_one_group_warms_up_one_start_for_its_agents():
  """Agents of one architecture other than the top-level model's: one group, one warm-up
  start, whose parameters start both agents."""
  c = _team_config()
  c.model.num_layers = 1  # the top-level model: one block; the agents: the preset's two
  c.agents.presets = ("tiny", "tiny")
  c.sft.steps, c.sft.check_every, c.sft.until_success = 1, 1, 0.0
  parts = components.build(experiment.validate(c))
  assert [g.agents for g in parts.exp.agents.team] == [(0, 1)]
  start = jax.device_get(nnx.to_pure_dict(nnx.state(parts.policies.models[0], nnx.Param)))
  state, history = warmup.warm_up(parts)
  assert isinstance(state, TeamState) and [r["sft_step"] for r in history] == [1]
  first, second = [nnx.to_pure_dict(p) for p in parts.policies.per_policy(state.params)]
  assert jax.tree.structure(first) == jax.tree.structure(start)
  for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  moved = [
      np.abs(np.asarray(x) - np.asarray(y)).max()
      for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(start))
  ]
  assert max(moved) > 0


@pytest.fixture(scope="module")
def team_runs(tmp_path_factory):
  """A team of the smoke preset (d32) and a d128 checkpoint of vocabulary 384:

  full      the uninterrupted 2-step run
  resumed   that run as it stood after step 1, continued to step 2
  """
  me = "tests.train.test_team"

  def train(base):
    teammate = os.path.join(base, "teammate")
    teammate_model = models.create_model(models.get_preset("small", vocab_size=384), seed=5)
    # A fresh preset's tied unit-variance embedding gives saturated logits (no gradient);
    # a smaller one gives the teammate a policy that samples and learns.
    teammate_model.embed[...] = teammate_model.embed[...] * 0.05
    loading.save_pretrained(teammate_model, teammate)
    full = {"config": [me, "_team_config", [2, teammate]], "workdir": f"{base}/full"}
    run_on_one_device([full, dict(full, workdir=f"{base}/resumed", resume_of=[f"{base}/full", 1])])

  # Built once per `pytest` run: the first xdist worker to ask builds it, the others reuse it.
  base = testing.built_once(tmp_path_factory, "team_runs", train)
  return {
      "teammate": os.path.join(base, "teammate"),
      "full": os.path.join(base, "full"),
      "resumed": _rows(os.path.join(base, "resumed")),
  }


@pytest.mark.slow
def test_a_team_of_two_architectures_trains_and_resumes_exactly(team_runs):
  rows = _rows(team_runs["full"])
  for a in (0, 1):
    for k in ("train/loss", "train/kl", "batch/actions"):
      assert f"agent_{a}/{k}" in rows[1], (a, k)
  assert rows[1]["agent_1/train/learning_rate"] == pytest.approx(3e-3, rel=1e-6)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert team_runs["resumed"] == rows


@pytest.mark.slow
def test_a_team_exports_each_agent_with_its_own_architecture(team_runs, tmp_path):
  policy = saved.load_policy(team_runs["full"], "latest")
  info = saved.export_policy(policy, str(tmp_path / "hf"))
  assert [os.path.basename(a["out"]) for a in info["agents"]] == ["agent_0", "agent_1"]
  widths = []
  for a, model in enumerate(policy.models()):
    out = tmp_path / "hf" / f"agent_{a}"
    hf = json.loads((out / "config.json").read_text())
    widths.append((hf["hidden_size"], hf["vocab_size"]))
    back = loading.from_pretrained(str(out))
    tokens = jnp.asarray(np.random.RandomState(a).randint(0, 260, (2, 9)), jnp.int32)
    np.testing.assert_array_equal(testing.logits(back, tokens), testing.logits(model, tokens))
  assert widths == [(policy.exp.model.arch.d_model, policy.exp.model.arch.vocab_size), (128, 384)]
  # The teammate trained: its weights left the checkpoint it started from.
  start = nnx.state(loading.from_pretrained(team_runs["teammate"]), nnx.Param)
  now = nnx.state(policy.models()[1], nnx.Param)
  moved = [
      float(np.abs(np.asarray(x) - np.asarray(y)).max())
      for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(now))
  ]
  assert max(moved) > 0


@pytest.mark.slow  # a team run of two tokenizers (~14 s on 2 cores)
def test_each_agent_renders_with_its_own_tokenizer(tmp_path, monkeypatch):
  """Agent 1's checkpoint brings a tokenizer of its own (other merges, other special
  ids): its prompts are its tokenizer's ids, agent 0's the run's, and both train.
  Validation and the build read each agent's checkpoint once."""
  base = testing.hf_checkpoint(str(tmp_path / "base"))
  teammate = testing.hf_checkpoint(
      str(tmp_path / "teammate"),
      preset="small",
      tokenizer_vocab=270,  # fewer merges than the base's (its corpus allows 292)
      model_vocab=384,
      seed=1,
      embed_scale=0.05,
  )
  c = _team_config(path=teammate)
  c.model.path, c.tokenizer.kind, c.tokenizer.chat_format = base, "hf", "chatml"
  c.tokenizer.extra_specials = ""
  reads = []
  monkeypatch.setattr(
      groups, "read_checkpoints", lambda e, real=groups.read_checkpoints: reads.append(1) or real(e)
  )
  exp = experiment.validate(c)
  assert [g.tokenizer_dir for g in exp.agents.team] == [base, teammate]
  assert [groups.agent_tokenizer_dir(exp, a) for a in (0, 1)] == [base, teammate]
  parts = components.build(exp)
  assert len(reads) == 1
  toks = [r.tokenizer for r in parts.transition.renderers]
  start = [t.encode("<|im_start|>") for t in toks]
  # Each tokenizer's own special id (added after its merges).
  assert start == [[toks[0].vocab_size - 2], [toks[1].vocab_size - 2]] and start[0] != start[1]
  records, metrics, *_ = _one_step(parts, jax.random.PRNGKey(0))
  for rec in records:
    for a, tok in enumerate(toks):
      ids = rec["prompt_ids"][a]
      text = tok.decode(ids)
      assert text.startswith("<|im_start|>") and tok.encode(text) == ids, (rec["node_id"], a)
      other = toks[1 - a]  # the other tokenizer reads these ids otherwise, if at all
      assert max(ids) >= other.vocab_size or other.decode(ids) != text, (rec["node_id"], a)
  for a in (0, 1):
    assert np.isfinite(metrics[f"agent_{a}/train/loss"]), a


@pytest.mark.slow  # a rollout, an update and two exports
def test_a_lora_team_with_a_frozen_agent_updates_only_the_trained_adapters(tmp_path):
  """Adapters over each group's own base; agent 1 (another architecture) frozen: its
  merged weights stay bit-identical, and each agent exports its adapters (PEFT) and
  its merged weights with its own architecture."""
  from mtrl_jax.train import export_lora

  c = _team_config()
  c.agents.presets = ("", "small")
  c.agents.trainable = (True, False)
  c.model.lora.rank = 4
  parts = components.build(experiment.validate(c))
  policies = parts.policies
  state = policies.init_state()
  # Start-up compiles both groups' engines (agent 1's alone: its plain parameters) and
  # only the update of the group that trains.
  engines, steps = parts.compile_targets(state.params)
  assert [e for e, _, _ in engines] == list(parts.engines)
  assert [n for *_, n in engines] == [len(p.stop_ids) for p in parts.rollout_policy.policies]
  shapes = [x.shape for x in jax.tree.leaves(nnx.state(policies.models[1], nnx.Param))]
  assert [x.shape for x in jax.tree.leaves(engines[1][1])] == shapes
  assert steps == [policies.train_step.steps[0]]
  before = [jax.device_get(nnx.to_pure_dict(p)) for p in policies.per_policy(state.params)]
  parts.rollout_policy.set_states(policies.sampler_states(state.params))
  roots = parts.transition.root_states(parts.factory, indexed(parts.train_tasks, 2))
  tree = expand_tree(
      parts.exp.tree, parts.rollout_policy, parts.transition, roots, jax.random.PRNGKey(1)
  )
  batch, m = policies.make_batch(tree, parts.batch_cfg)
  assert batch[1] is None  # the frozen group's: nothing to pack, no token slots
  assert m["batch/padding_fraction"] == 1.0 - m["batch/tokens_trained"] / batch[0].tokens_BxL.size
  batch = policies.train_step.old_logprobs(state.params, batch)
  state, dm = policies.train_step(state, None, batch)
  metrics = policies.train_metrics(dm)
  assert "agent_0/train/loss" in metrics and not any(k.startswith("agent_1/") for k in metrics)
  after = [jax.device_get(nnx.to_pure_dict(p)) for p in policies.per_policy(state.params)]
  for x, y in zip(jax.tree.leaves(before[1]), jax.tree.leaves(after[1])):
    np.testing.assert_array_equal(x, y)
  moved = [
      np.abs(x - y).max() for x, y in zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0]))
  ]
  assert max(moved) > 0
  peft = export_lora.save_adapters(policies, state.params, str(tmp_path / "peft"))
  assert [os.path.basename(d) for d in peft] == ["agent_0", "agent_1"]
  merged = export_lora.save_merged(policies, state.params, str(tmp_path / "merged"))
  widths = [json.loads(open(os.path.join(d, "config.json")).read())["hidden_size"] for d in merged]
  assert widths == [parts.exp.model.arch.d_model, 128]
  for d, want in zip(merged, after):
    back = nnx.to_pure_dict(nnx.state(loading.from_pretrained(d), nnx.Param))
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(x), y)
