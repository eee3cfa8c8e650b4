"""Tree packing equals one row per action: loss, every metric and every gradient.

Random trees cover T 1-3, G 2-4, N 1-2, align and cross, terminated nodes,
fault-masked actions, user-turn sub-steps (completions with tool context
inside), a shared system prompt across roots, and an environment that rewrites
history (a child prompt that does not extend its parent's). The reference is
the row layout (`pack_rows`: one causal row per action) scored by the plain
causal forward (`model(tokens)` and `losses.token_logprobs`), which the rest
of the suite checks against hand-worked values and numpy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import losses, models, sharding
from mtrl_jax.models.transformer import tree_attention_mask
from mtrl_jax.rollout import Completion, Tree, TreeConfig
from mtrl_jax.rollout.train_batch import FIELDS, as_arrays, batch_spec, logit_buckets
from mtrl_jax.rollout.tree_packing import pack_actions, pack_rows, tree_actions
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep
from mtrl_jax.train.objectives import PolicyObjective, train_mask
from mtrl_jax.train.forward import forward_logprobs

CFG = models.get_preset("tiny")
ROW_LENGTHS = (16, 32, 64, 128, 256)  # the row layout takes the smallest that fits
FAST = (("xla_backend_optimization_level", 0),)
TEMPERATURE = 0.7  # of the policy's sampled logprobs and of every loss


@functools.cache
def _model():
  return models.create_model(CFG, seed=0)


def _toks(r, n):
  return [int(x) for x in r.randint(3, CFG.vocab_size, n)]


def random_tree(
    seed,
    *,
    turns,
    gens,
    agents,
    mode="align",
    substeps=False,
    faults=True,
    rewrite=False,
    tau=None,
    roots=2
):
  """A finalized tree with random tokens; logprobs are filled in by `_with_policy_logprobs`."""
  r = np.random.RandomState(seed)
  cfg = TreeConfig(
      num_turns=turns,
      num_generations=gens,
      num_agents=agents,
      joint_mode=mode,
      termination_threshold=tau,
      discount=0.9,
  )
  tree = Tree(cfg)
  system = _toks(r, 5)  # shared by every root: packed once per row
  frontier = [
      tree.add_root([system + _toks(r, r.randint(1, 4)) for _ in range(agents)])
      for _ in range(roots)
  ]
  while frontier:
    nxt = []
    for node in frontier:
      comps = []
      for _ in range(agents):
        per = []
        for _ in range(gens):
          ids = np.asarray(_toks(r, r.randint(1, 5)), np.int32)
          c = Completion(ids, np.zeros(len(ids), np.float32))
          if substeps and r.rand() < 0.5:  # a tool round trip inside the action
            seg = np.asarray(_toks(r, r.randint(1, 4)), np.int32)
            c = c.continued(
                _toks(r, r.randint(1, 3)), Completion(seg, np.zeros(len(seg), np.float32))
            )
          per.append(c)
        comps.append(per)
      tree.set_completions(node, comps)
      b = cfg.branching
      rewards = r.randint(0, 3, b).astype(float)
      valid = np.ones(b, bool)
      if faults and r.rand() < 0.3:
        valid[r.randint(b)] = False
      if tree.record(node, rewards, valid):
        for j in range(b):
          if not valid[j] or r.rand() < 0.25:  # some actions end the episode
            continue
          prompts = []
          for i in range(agents):
            g = tree.joint_BxN[j, i]
            if rewrite and r.rand() < 0.2:  # history rewritten: no shared prefix
              prompts.append(_toks(r, r.randint(3, 8)))
            else:
              prompts.append(
                  node.prompts[i] + list(node.completions[i][g].ids) + _toks(r, r.randint(1, 3))
              )
          nxt.append(tree.add_child(node, j, prompts))
    frontier = nxt
  return tree.finalize()


@functools.cache
def _split():
  return nnx.split(_model(), nnx.Param)


@jax.jit
def _plain_logprobs(params, tokens_BxL):
  """Per-token logprobs at the trained temperature of the plain causal forward
  (position t scores token t)."""
  return losses.token_logprobs(
      nnx.merge(_split()[0], params)(tokens_BxL), tokens_BxL, temperature=TEMPERATURE
  )


def _with_policy_logprobs(tree, noise_seed=0):
  """Sets each completion's sampled logprobs to the policy's own plus noise.

  Ratios then sit near 1 (some clipped), as in training; unrelated logprobs
  would give ratios of e^±15 whose gradients are float32 rounding noise.
  The paths are scored in a batch padded to a multiple of 64 rows of 64 (or
  256) tokens: one compiled forward serves every tree of the module.
  """
  every = [
      (node, i, g)
      for node in tree.nodes
      for i in range(tree.cfg.num_agents)
      for g in range(len(node.completions[i]))
  ]
  paths = [list(node.prompts[i]) + list(node.completions[i][g].ids) for node, i, g in every]
  width = 64 if max(map(len, paths)) <= 64 else max(ROW_LENGTHS)
  tokens = np.zeros((-(-len(every) // 64) * 64, width), np.int32)
  for b, path in enumerate(paths):
    tokens[b, : len(path)] = path
  logp = np.asarray(_plain_logprobs(_split()[1], tokens))
  r = np.random.RandomState(noise_seed)
  for b, (node, i, g) in enumerate(every):
    comp = node.completions[i][g]
    p, c = len(node.prompts[i]), len(comp.ids)
    lp = (logp[b, p : p + c] + 0.1 * r.randn(c)) * comp.sampled_mask
    node.completions[i][g] = Completion(
        comp.ids, lp.astype(np.float32), comp.finish_reason, comp.trainable
    )
  return tree


def _used_rows(batch):
  """Rows holding a trained token."""
  return int(batch.loss_mask_BxK.any(1).sum())


def _rows(tree, **kw):
  return pack_rows(tree_actions(tree), length_buckets=kw.pop("length_buckets", ROW_LENGTHS), **kw)[
      0
  ]


# Between them: T 1-3, G 2-4, N 1-2, align and cross, early termination (tau),
# fault-masked actions (every case), sub-steps, rewritten histories.
CASES = [
    dict(turns=1, gens=4, agents=1),
    dict(turns=3, gens=2, agents=1, tau=1.5, rewrite=True, substeps=True),
    dict(turns=2, gens=3, agents=2, mode="align"),
    dict(turns=3, gens=2, agents=2, mode="cross", tau=1.2, substeps=True),
]


@functools.partial(jax.jit, static_argnames=("cfgs", "plain"))
def _evaluate(params, ref_params, batch, cfgs, plain):
  """Loss, metrics and parameter gradient of each loss configuration on one batch layout.

  One program per layout: the forward (policy and reference), every loss of
  `cfgs`, and the gradients, each loss's cotangent on the per-token logprobs
  pulled back through the one forward (the chain rule the train step's
  value_and_grad applies in one piece) in a loop over the losses (`lax.map`:
  a `vmap` of this pullback over cotangents gives wrong attention-query
  gradients on CPU once losses x rows x tokens pass ~1024 rows of 16, jax
  0.10.2). `plain`:
  the forward is the plain causal one over whole rows (`model(tokens)`,
  `losses.token_logprobs`), read at each trained token's row position: the
  reference for row batches.
  """
  graphdef = _split()[0]
  at_BxK = batch.prev_BxK + 1  # a row's trained token t is scored from t - 1

  def fwd(p):
    """(logprobs [B, K], entropies [B, K] without gradient)."""
    if not plain:
      return forward_logprobs(graphdef, p, batch, 0, True, TEMPERATURE)[:2]
    logits = nnx.merge(graphdef, p)(batch.tokens_BxL)
    logp = losses.token_logprobs(logits, batch.tokens_BxL, temperature=TEMPERATURE)
    entropy = losses.token_entropy(jax.lax.stop_gradient(logits), temperature=TEMPERATURE)
    take = lambda x: jnp.take_along_axis(x, at_BxK, axis=1)
    return take(logp), take(entropy)

  logp, pull, entropy = jax.vjp(fwd, params, has_aux=True)
  ref = fwd(ref_params)[0]
  out, cts = [], []
  for cfg in cfgs:
    obj = PolicyObjective(cfg, temperature=TEMPERATURE)

    def f(lp, obj=obj, kl=bool(cfg.kl_coef)):
      num, den, sums = obj.terms(lp, ref if kl else None, entropy, batch)
      return num / jnp.maximum(den, 1), sums

    (loss, sums), ct = jax.value_and_grad(f, has_aux=True)(logp)
    out.append((loss, obj.finalize(sums)))
    cts.append(ct)
  grads = jax.lax.map(lambda ct: pull(ct)[0], jnp.stack(cts))
  return out, grads


def _losses_metrics_grads(batch, plain=False):
  """[(loss, metrics, grads)] of each of `LOSSES` on one layout (see `_evaluate`)."""
  out, grads = _evaluate(
      _split()[1], _ref_params(), jax.tree.map(jnp.asarray, batch), LOSSES, plain
  )
  out, grads = jax.device_get((out, grads))
  return [
      (
          float(loss),
          {k: float(v) for k, v in metrics.items()},
          jax.tree.map(lambda g, c=c: g[c], grads),
      )
      for c, (loss, metrics) in enumerate(out)
  ]


def _assert_same(a, b, what):
  """Equal within 1e-5, gradients within 1e-5 of each leaf's largest entry.

  The packed forward runs matmuls of other shapes than the row layout, so
  float32 sums come in another order: per-token logprobs differ by up to
  ~1e-5 (temperature 0.7), gradient entries by ~1e-5 of the gradient's own
  scale (a reordering of the same rows gives ~1e-7). A packing error (a wrong
  position, a token attending off its path, an action counted twice) moves
  them by orders of magnitude more.
  """
  (la, ma, ga), (lb, mb, gb) = a, b
  assert la == pytest.approx(lb, rel=1e-5, abs=1e-5), what
  assert set(ma) == set(mb)
  for k in mb:
    assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-5), (what, k)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    y = np.asarray(y)
    np.testing.assert_allclose(
        np.asarray(x), y, rtol=1e-5, atol=1e-5 * max(np.abs(y).max(), 1), err_msg=str(what)
    )


@functools.cache
def _ref_params():
  """A reference near the policy, as in training (KL ~0.05 nats per token): a far one
  (KL ~15) has k3's exp(ref - logp) amplify float32 rounding past the tolerance."""
  graphdef, params = _split()
  r = np.random.RandomState(7)
  return jax.tree.map(lambda x: x + 0.003 * r.randn(*x.shape).astype(x.dtype), params)


# The packing-dependent parts of a loss: the sequence ratio (gspo) against the
# token ratio (grpo, reinforce), each aggregation (the seq-mean ones group tokens
# by action), KL off and on (the reference forward through the layout) with each
# estimator. Each algorithm x aggregation x estimator's arithmetic is checked
# against float64 references in tests/losses.
LOSSES = (
    losses.LossConfig(
        algorithm="grpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2
    ),
    losses.LossConfig(
        algorithm="gspo",
        aggregation="seq-mean-token-mean",
        kl_coef=0.1,
        kl_estimator="k1",
        clip_eps_low=0.05,
        clip_eps_high=0.05,
    ),
    losses.LossConfig(
        algorithm="reinforce", aggregation="seq-mean-token-sum", kl_coef=0.1, kl_estimator="k2"
    ),
    losses.LossConfig(
        algorithm="grpo",
        aggregation="seq-mean-token-sum-norm",
        max_len=256,
        kl_coef=0.1,
        kl_estimator="k3",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    ),
)


@functools.cache
def _tree(case):
  """The random tree of `CASES[case]` with the policy's logprobs, built once."""
  return _with_policy_logprobs(random_tree(100 + case, **CASES[case]))


# Every case's rows fit one shape, and their packings fit 8 rows of 64: the
# cases share compiled programs wherever their shapes agree.
REF_ROWS = dict(length_buckets=(32,), row_buckets=(64,))
PACKED = dict(length=64, row_buckets=(8,))


@functools.cache
def _row_reference(case):
  """The row layout's [(loss, metrics, grads)] of every `LOSSES` on `_tree(case)`."""
  return _losses_metrics_grads(_rows(_tree(case), **REF_ROWS), plain=True)


@pytest.mark.parametrize(
    "case", [0] + [pytest.param(c, marks=pytest.mark.slow) for c in range(1, len(CASES))]
)
def test_tree_packing_equals_rows_for_each_algorithm_aggregation_and_kl(case):
  tree, want = _tree(case), _row_reference(case)
  packed, stats = pack_actions(tree_actions(tree), **PACKED)
  assert stats["tokens_trained"] < stats["tokens_rows_equivalent"]
  got = _losses_metrics_grads(packed)
  for cfg, g, w in zip(LOSSES, got, want):
    _assert_same(g, w, cfg)
  # The losses differ from each other: each configuration is its own check.
  assert len({round(w[0], 6) for w in want}) == len(LOSSES)


def test_every_trained_token_once_and_only_policy_tokens():
  tree = random_tree(3, turns=3, gens=3, agents=2, mode="cross", substeps=True)
  rows = _rows(tree)
  packed, stats = pack_actions(tree_actions(tree), length=32, row_multiple=4)
  assert packed.tokens_BxL.shape[0] % 4 == 0
  # Same multiset of (target token, old logprob) over trained tokens; in rows each
  # trained token sits right after the position it is scored from.
  m = rows.loss_mask_BxK & (rows.row_weight_B > 0)[:, None]
  b_idx, k_idx = np.nonzero(m)
  np.testing.assert_array_equal(rows.tokens_BxL[b_idx, rows.prev_BxK[m] + 1], rows.target_BxK[m])
  want = sorted(zip(rows.target_BxK[m].tolist(), rows.old_logp_BxK[m].tolist()))
  got = sorted(
      zip(
          packed.target_BxK[packed.loss_mask_BxK].tolist(),
          packed.old_logp_BxK[packed.loss_mask_BxK].tolist(),
      )
  )
  assert got == want
  assert packed.target_BxK.shape[1] in logit_buckets(32)
  # Row-equivalent tokens: what one row per trained action holds.
  n_rows = int((rows.row_weight_B > 0).sum())
  assert stats["actions"] == n_rows
  assert 0 <= stats["padding_fraction"] < 1


def test_subtrees_split_to_fit_short_rows_still_equal():
  tree = _tree(1)  # three turns: subtrees below subtrees
  longest = max(len(n.prompts[0]) + len(c.ids) for n in tree.nodes for c in n.completions[0])
  short, _ = pack_actions(tree_actions(tree), length=longest)  # forces splits
  whole, _ = pack_actions(tree_actions(tree), **PACKED)
  assert _used_rows(short) > _used_rows(whole)
  got = _losses_metrics_grads(short)
  for cfg, g, w in zip(LOSSES, got, _row_reference(1)):
    _assert_same(g, w, cfg)
    assert g[1]["rows"] == w[1]["rows"]
  with pytest.raises(ValueError, match="exceeds the largest length bucket"):
    pack_actions(tree_actions(tree), length=longest - 1)


def test_attention_sees_only_its_own_path():
  """A token's output is unchanged when tokens outside its path are replaced."""
  tree = random_tree(5, turns=3, gens=2, agents=1, roots=2)
  packed, _ = pack_actions(tree_actions(tree), length=128)
  tokens, pos, ends = packed.tokens_BxL, packed.positions_BxL, packed.ends_BxL
  mask = np.asarray(tree_attention_mask(jnp.asarray(ends)))
  model = _model()
  fwd = jax.jit(lambda t: model.hidden(t, jnp.asarray(pos), tree_ends_BxL=jnp.asarray(ends)))
  base = np.asarray(fwd(jnp.asarray(tokens)))
  r = np.random.RandomState(0)
  for q in r.choice(int((tokens[0] != 0).sum()), 6, replace=False):
    off_path = ~mask[0, q]
    assert off_path.any()
    noisy = tokens.copy()
    noisy[0, off_path] = r.randint(3, CFG.vocab_size, int(off_path.sum()))
    out = np.asarray(fwd(jnp.asarray(noisy)))
    np.testing.assert_allclose(out[0, q], base[0, q], rtol=1e-5, atol=1e-6)
    # ...and the row layout's hidden state of the same token is the same vector.
  # The mask is ancestor-only: each token's ancestors are exactly its path.
  assert all(mask[0, q, q] for q in range(tokens.shape[1]))


@pytest.mark.several_devices
def test_equal_on_eight_devices_with_a_2x2x2_mesh():
  tree = _tree(2)  # two agents, aligned, two turns
  rows = _rows(tree, length_buckets=(32,), row_multiple=4)
  packed, _ = pack_actions(tree_actions(tree), length=32, row_buckets=(len(rows.tokens_BxL),))
  # The same shapes: one compiled step serves both layouts. The packed rows are
  # spread so that each of the 4 batch shards (data x fsdp) holds some of them.
  n = len(packed.tokens_BxL)
  assert packed.shape == rows.shape and 4 <= _used_rows(packed) <= n // 4
  to_row = [(i % 4) * (n // 4) + i // 4 for i in range(n)]  # packed row i to shard i % 4
  packed = jax.tree.map(lambda x: x[np.argsort(to_row)], packed)
  cfg = losses.LossConfig(algorithm="grpo", aggregation="seq-mean-token-mean", kl_coef=0.05)
  opt = OptimConfig(learning_rate=1e-3, eps=1e-4, grad_clip_norm=1.0)
  step = TrainStep(
      _model(),
      PolicyObjective(cfg),
      opt,
      mesh=sharding.make_mesh((2, 2, 2)),
      step_cfg=StepConfig(compiler_options=FAST),
  )
  ref = step.copy_params(step.init_state(_model()).params)
  out = {}
  for name, batch in (("rows", rows), ("tree", packed)):
    state, m = step(step.init_state(_model()), ref, batch)
    out[name] = (step.fetch_metrics(m), jax.device_get(state.params))
  assert step.num_compiles == 1
  (mr, pr), (mt, pt) = out["rows"], out["tree"]
  for k in mr:
    assert mt[k] == pytest.approx(mr[k], rel=1e-5, abs=1e-5), k
  for a, b in zip(jax.tree.leaves(pt), jax.tree.leaves(pr)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_spec_matches_batch():
  tree = random_tree(1, turns=2, gens=2, agents=1)
  packed, _ = pack_actions(tree_actions(tree), length=64)
  spec = batch_spec(*packed.shape)
  assert set(as_arrays(spec)) == set(as_arrays(packed)) == set(FIELDS)
  for k, v in as_arrays(packed).items():
    assert getattr(spec, k).shape == v.shape and getattr(spec, k).dtype == v.dtype, k
  assert train_mask(packed).shape == packed.loss_mask_BxK.shape
