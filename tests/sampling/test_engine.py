"""The rollout engine (`sampling.engine.DecodeEngine`) against the full, uncached forward pass.

Every sample is checked against an independent reference: the model's plain
causal forward over the whole sequence, re-run at every step (numpy float64
log-softmax). Extending a cached sample, forking G slots, evicting caches,
chunking decode, sharding slots over devices and stacking agents are layouts
of the same math and are tested for equality with the plain one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models, sharding
from mtrl_jax.metrics import CompileCensus
from mtrl_jax.sampling import DecodeEngine, EngineConfig, Request, SamplingConfig
from mtrl_jax.train.stacked import stack_trees

CFG = models.get_preset("tiny")  # float32
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [11], [40, 41, 42, 43, 44]]
SHORT = PROMPTS[:1] + PROMPTS[2:]  # with NEW tokens these fit 16-column slots
PAD = 0
ROWS, WIDTH = 16, 48  # reference forwards are padded to [ROWS, WIDTH]: one compile
KEY = np.asarray(jax.random.key_data(jax.random.key(7)), np.uint32)
# Same float32 math in another layout: log q differs by rounding. The plain tiny init
# has |logits| below ~30, where float32 spacing is ~2e-6.
TOL = 1e-5
# Tokens per sample: every PROMPTS row's prompt plus budget fits the smallest decode
# window (16 columns), so each engine configuration compiles one decode program.
NEW = 7


@functools.cache
def _split(seed):
  """(graphdef, state) of the tiny model of `seed`, built once."""
  return nnx.split(models.create_model(CFG, seed=seed))


def _scaled_state(seed, scale=3.0):
  """Random weights x scale: the plain tiny init just repeats its input token greedily."""
  _, state = _split(seed)
  return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)


@pytest.fixture(scope="module")
def state():
  """For greedy paths: sharp, varied argmax sequences."""
  return _scaled_state(0)


@pytest.fixture(scope="module")
def plain_state():
  """The plain init for 1e-5 float32 logprob comparisons."""
  return _scaled_state(0, scale=1.0)


@pytest.fixture(scope="module")
def full_forward():
  graphdef = _split(0)[0]
  return jax.jit(lambda st, toks: nnx.merge(graphdef, st)(toks))


def _new_engine(slots=16, capacity=64, chunk=4, mesh=None, agents=1, **kw):
  return DecodeEngine(
      CFG,
      EngineConfig(slots=slots, capacity=capacity, chunk=chunk, **kw),
      mesh=mesh,
      num_agents=agents,
  )


_ENGINES = {}


def _engine(**kw):
  """The module's one engine of this configuration: `start` begins every run afresh
  (slots, queue, stats; the pool keeps stale entries no run may read), and the
  engine's compiled programs carry over from test to test."""
  kw = {**dict(slots=16, capacity=64, chunk=4, mesh=None, agents=1, overlap=False), **kw}
  key = tuple(sorted(kw.items()))
  if key not in _ENGINES:
    _ENGINES[key] = _new_engine(**kw)
  return _ENGINES[key]


def _run(engine, params, requests, sampling, stop=(), fanout=4, release=True):
  """Submits `requests`, steps until every sample is back; samples by (tag, index).

  Runs take fanout 4 (the most samples a request asks for) unless the engine has
  fewer slots: the admit programs' shapes (their fork width) then agree across tests.
  """
  engine.start(params, sampling, stop, PAD, fanout=fanout)
  for r in requests:
    engine.submit(r)
  out, busy = {}, True
  while busy:
    samples, busy = engine.step()
    for s in samples:
      out[(s.tag, s.index)] = s
      if release:
        engine.release(s.handle)
  return out


def _requests(prompts, g, key=KEY, first_row=0):
  return [
      Request(p, prompt, key, np.arange(g) + first_row + p * g) for p, prompt in enumerate(prompts)
  ]


def _full_logprobs(full_forward, state, seqs):
  """float64 log_softmax of the uncached forward, [len(seqs), WIDTH, V]."""
  batch = np.full((ROWS, WIDTH), PAD, np.int32)  # right padding: causal, never read
  for i, x in enumerate(seqs):
    batch[i, : len(x)] = x
  logits = np.asarray(full_forward(state, jnp.asarray(batch)), np.float64)
  logits -= logits.max(axis=-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def _check_against_full_forward(full_forward, state, prompts, samples, g):
  seqs = [
      list(prompts[p]) + samples[(p, k)].ids.tolist() for p in range(len(prompts)) for k in range(g)
  ]
  logp = _full_logprobs(full_forward, state, seqs)
  for i, seq in enumerate(seqs):
    p, k = divmod(i, g)
    n0, s = len(prompts[p]), samples[(p, k)]
    ref = [logp[i, n0 + t - 1, s.ids[t]] for t in range(len(s.ids))]
    np.testing.assert_allclose(s.logprobs, ref, rtol=0, atol=TOL)


def test_greedy_equals_stepwise_argmax_of_full_forward(state, full_forward):
  steps = NEW
  out = _run(
      _engine(), state, _requests(PROMPTS, 2), SamplingConfig(greedy=True, max_new_tokens=steps)
  )
  seqs = [list(p) for p in PROMPTS]
  for _ in range(steps):  # no cache: re-run every sequence, argmax at its end
    logp = _full_logprobs(full_forward, state, seqs)
    for i, s in enumerate(seqs):
      s.append(int(np.argmax(logp[i, len(s) - 1])))
  for p, prompt in enumerate(PROMPTS):
    for k in range(2):  # both forks of a prompt agree
      assert out[(p, k)].ids.tolist() == seqs[p][len(prompt) :]
      assert out[(p, k)].finish_reason == "length"
  assert len({tuple(s) for s in seqs}) == len(PROMPTS)  # not a degenerate model


def test_sampled_logprobs_equal_full_forward_log_softmax(plain_state, full_forward):
  out = _run(_engine(), plain_state, _requests(PROMPTS, 3), SamplingConfig(max_new_tokens=NEW))
  _check_against_full_forward(full_forward, plain_state, PROMPTS, out, 3)
  assert len({tuple(out[(0, k)].ids) for k in range(3)}) > 1  # forks are sampled, not copied


def test_a_sample_depends_on_its_request_alone(plain_state):
  # Fork G slots from one prefill == G one-sample requests with the same rows;
  # the samples do not depend on who else is decoding or how slots are laid out.
  cfg = SamplingConfig(temperature=1.3, max_new_tokens=NEW)
  forked = _run(_engine(), plain_state, _requests(PROMPTS, 3), cfg, stop=[5])
  single = [
      Request((p, k), prompt, KEY, [p * 3 + k])
      for p, prompt in enumerate(PROMPTS)
      for k in range(3)
  ]
  alone = _run(_engine(slots=4, chunk=3), plain_state, single[::-1], cfg, stop=[5])
  for (p, k), s in forked.items():
    twin = alone[((p, k), 0)]
    np.testing.assert_array_equal(s.ids, twin.ids)
    np.testing.assert_allclose(s.logprobs, twin.logprobs, rtol=0, atol=TOL)
    assert s.finish_reason == twin.finish_reason


def test_a_samples_bits_do_not_depend_on_a_long_batch_mate(plain_state):
  # A 40-token batch-mate needs a wider window than the short prompt's rows; each
  # row decodes over a window set by its own prompt and budget, so the short
  # samples keep every bit (float rounding changes with the window).
  cfg = SamplingConfig(temperature=1.3, max_new_tokens=10)
  short = _requests([PROMPTS[0]], 2)
  alone = _run(_engine(), plain_state, short, cfg)
  mate = Request("long", list(range(1, 41)), KEY, [9, 10])
  shared = _run(_engine(), plain_state, [mate] + short, cfg)
  for key, s in alone.items():
    np.testing.assert_array_equal(shared[key].ids, s.ids)
    np.testing.assert_array_equal(shared[key].logprobs, s.logprobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_extending_a_cached_sample_equals_a_fresh_prefill(plain_state, full_forward, overlap):
  """With overlap, the decode call dispatched before a finish is read still names the
  finished sample's slot: it takes no step there and leaves the cache the child reads."""
  cfg = SamplingConfig(max_new_tokens=NEW)
  engine = _engine(overlap=overlap)
  first = _run(engine, plain_state, _requests(PROMPTS, 2), cfg, release=False)
  # Children: the parent prompt, its sample, then 3 "environment" tokens.
  kids = [
      Request(
          (p, k),
          list(PROMPTS[p]) + first[(p, k)].ids.tolist() + [7, 8, 9],
          KEY,
          [100 + p * 2 + k],
          parent=first[(p, k)].handle,
      )
      for p in range(len(PROMPTS))
      for k in range(2)
  ]
  for r in kids:
    engine.submit(r)
    engine.release(r.parent)
  out, busy = {}, True
  while busy:
    samples, busy = engine.step()
    out.update({s.tag: s for s in samples})
  stats = engine.stats
  assert stats["reused_tokens"] == sum(len(r.parent.ids) for r in kids)
  assert stats["prefill_tokens"] == sum(len(p) - 1 for p in PROMPTS) + 3 * len(kids)
  fresh = _run(_engine(), plain_state, [Request(r.tag, r.prompt, KEY, r.rows) for r in kids], cfg)
  prompts = [r.prompt for r in kids]
  seqs = [prompts[i] + out[r.tag].ids.tolist() for i, r in enumerate(kids)]
  logp = _full_logprobs(full_forward, plain_state, seqs)
  for i, r in enumerate(kids):
    got, want = out[r.tag], fresh[(r.tag, 0)]
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=TOL)
    ref = [logp[i, len(r.prompt) + t - 1, got.ids[t]] for t in range(len(got.ids))]
    np.testing.assert_allclose(got.logprobs, ref, rtol=0, atol=TOL)


def test_a_rewritten_history_extends_from_the_longest_common_prefix(plain_state):
  cfg = SamplingConfig(max_new_tokens=6)
  engine = _engine()
  (parent,) = _run(
      engine, plain_state, [Request("a", PROMPTS[1], KEY, [0])], cfg, release=False
  ).values()
  rewritten = PROMPTS[1][:4] + [60, 61] + parent.ids.tolist()  # earlier turns changed
  engine.submit(Request("b", rewritten, KEY, [9], parent=parent.handle))
  engine.release(parent.handle)
  busy, got = True, []
  while busy:
    samples, busy = engine.step()
    got += samples
  assert engine.stats["reused_tokens"] == 4  # the cache is trusted up to the rewrite only
  (want,) = _run(_engine(), plain_state, [Request("b", rewritten, KEY, [9])], cfg).values()
  np.testing.assert_array_equal(got[0].ids, want.ids)
  np.testing.assert_allclose(got[0].logprobs, want.logprobs, rtol=0, atol=TOL)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_tiny_kv_budget_evicts_and_samples_the_same(plain_state, overlap):
  cfg = SamplingConfig(max_new_tokens=4)  # the children too decode in 16 columns
  results = []
  for slots in (16, 2):
    engine = _engine(slots=slots, overlap=overlap and slots == 2)
    first = _run(engine, plain_state, _requests(SHORT, 2), cfg, fanout=min(slots, 4), release=False)
    for (p, k), s in first.items():
      engine.submit(
          Request((p, k), list(SHORT[p]) + s.ids.tolist() + [7], KEY, [50 + k], parent=s.handle)
      )
      engine.release(s.handle)
    out, busy = {}, True
    while busy:
      samples, busy = engine.step()
      out.update({x.tag: x for x in samples})
    results.append((out, dict(engine.stats)))
  (roomy, roomy_stats), (tight, tight_stats) = results
  assert tight_stats["evictions"] > 0 and roomy_stats["evictions"] == 0
  assert tight_stats["prefill_tokens"] > roomy_stats["prefill_tokens"]
  for tag, s in roomy.items():
    np.testing.assert_array_equal(tight[tag].ids, s.ids)
    np.testing.assert_allclose(tight[tag].logprobs, s.logprobs, rtol=0, atol=TOL)


def test_top_k_top_p_sample_only_allowed_tokens(plain_state, full_forward):
  k, top_p, temp = 4, 0.8, 0.9
  out = _run(
      _engine(),
      plain_state,
      _requests(PROMPTS, 4),
      SamplingConfig(temperature=temp, top_k=k, top_p=top_p, max_new_tokens=NEW),
  )
  seqs = [list(PROMPTS[p]) + out[(p, g)].ids.tolist() for p in range(4) for g in range(4)]
  logp_full = _full_logprobs(full_forward, plain_state, seqs)
  for i in range(16):
    p, g = divmod(i, 4)
    n0, s = len(PROMPTS[p]), out[(p, g)]
    for t, tok in enumerate(s.ids):
      z = logp_full[i, n0 + t - 1] / temp  # log-softmax shifts, temperature scales
      order = np.argsort(-z, kind="stable")[:k]
      q = np.exp(z[order] - z[order].max())
      q /= q.sum()
      keep = (np.cumsum(q) - q) < top_p
      allowed = order[keep]
      assert tok in allowed
      q = q[keep] / q[keep].sum()
      np.testing.assert_allclose(s.logprobs[t], np.log(q[list(allowed).index(tok)]), atol=TOL)


def test_stop_ids_end_samples_and_are_included(state):
  greedy = SamplingConfig(greedy=True, max_new_tokens=NEW)
  free = _run(_engine(), state, _requests(PROMPTS, 1), greedy)
  stops = [int(free[(0, 0)].ids[3]), int(free[(2, 0)].ids[5])]  # several stop ids at once
  out = _run(_engine(), state, _requests(PROMPTS, 1), greedy, stop=stops)
  for p in range(len(PROMPTS)):
    ids, s = free[(p, 0)].ids, out[(p, 0)]
    hits = [t for t in range(NEW) if ids[t] in stops]
    if hits:
      n = hits[0] + 1
      assert s.finish_reason == "stop" and len(s.ids) == n and s.ids[-1] in stops
      np.testing.assert_array_equal(s.ids, ids[:n])
      np.testing.assert_allclose(s.logprobs, free[(p, 0)].logprobs[:n], atol=TOL)
    else:
      assert s.finish_reason == "length" and len(s.ids) == NEW
  assert out[(0, 0)].finish_reason == out[(2, 0)].finish_reason == "stop"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [1, 16])  # chunk 3 against 4: the test of forks above
def test_decode_chunk_and_overlap_change_nothing(plain_state, chunk, overlap):
  """Against chunks of 4 read as they finish: other chunks, and reading each chunk while
  the next decodes (`EngineConfig.overlap`), give the same samples."""
  cfg = SamplingConfig(max_new_tokens=NEW, temperature=0.8)
  ref = _run(_engine(chunk=4, overlap=False), plain_state, _requests(PROMPTS, 2), cfg, stop=[9])
  engine = _engine(chunk=chunk, overlap=overlap)
  out = _run(engine, plain_state, _requests(PROMPTS, 2), cfg, stop=[9])
  for tag, s in ref.items():
    np.testing.assert_array_equal(out[tag].ids, s.ids)
    np.testing.assert_allclose(out[tag].logprobs, s.logprobs, rtol=0, atol=TOL)
    assert out[tag].finish_reason == s.finish_reason
  # Every row decodes in one window, so the steps run one after another are the
  # longest sample's, whatever the chunk: NEW steps, in ceil(NEW / chunk) calls; with
  # overlap one more, which takes no step (dispatched before the last finish was read).
  longest = max(len(s.ids) for s in out.values())
  assert engine.stats["decode_steps"] == longest
  assert engine.stats["decode_calls"] == -(-longest // chunk) + overlap


def test_new_weights_and_sizes_in_the_same_buckets_do_not_recompile(state):
  engine = _engine()
  cfg = SamplingConfig(max_new_tokens=10)
  _run(engine, state, _requests(PROMPTS, 2), cfg, stop=[3])
  compiled = engine.num_compiles
  census = CompileCensus()
  census.register("engine", engine)
  other = _scaled_state(1)
  cfg2 = SamplingConfig(temperature=0.5, max_new_tokens=9)
  prompts = [[7, 8], [9] * 14, [4, 4, 4]]
  a = _run(engine, other, _requests(prompts, 2), cfg2, stop=[1, 2])
  b = _run(engine, state, _requests(prompts, 2), cfg2, stop=[1, 2])
  assert engine.num_compiles == compiled and census.counts()["compiles/backend_total"] == 0
  assert any(not np.array_equal(a[t].ids, b[t].ids) for t in a)  # the new weights were used


@pytest.mark.several_devices
@pytest.mark.parametrize("explicit", [False, True])
def test_slots_sharded_over_devices_sample_what_one_device_does(explicit, state):
  # Over data x fsdp (4 batch shards) with the KV heads split over tensor.
  cfg = SamplingConfig(greedy=True, max_new_tokens=NEW)
  ref = _run(_engine(capacity=16), state, _requests(SHORT, 2), cfg, stop=[7])
  if explicit:  # jax.make_mesh's default (Explicit axes); the engine re-types them Auto
    mesh = jax.make_mesh((2, 2, 2), sharding.MESH_AXES)
  else:
    mesh = sharding.make_mesh((2, 2, 2))
  out = _run(_engine(slots=4, capacity=16, mesh=mesh), state, _requests(SHORT, 2), cfg, stop=[7])
  for tag, s in ref.items():
    np.testing.assert_array_equal(out[tag].ids, s.ids)
    # Sharded contractions sum in another order; the x3 weights reach |logits| ~75,
    # where one float32 ulp is 7.6e-6: allow a few (8).
    np.testing.assert_allclose(out[tag].logprobs, s.logprobs, atol=8 * np.spacing(np.float32(75)))
    assert out[tag].finish_reason == s.finish_reason


@pytest.mark.parametrize(
    "mesh_shape", [None, pytest.param((2, 2, 2), marks=pytest.mark.several_devices)]
)
def test_precompiled_programs_run_without_compiling(mesh_shape, state):
  # A fresh engine of the sharded test's configuration (or of its one-device
  # reference's): its programs may come from the persistent compilation cache.
  mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
  engine = _new_engine(slots=16 if mesh is None else 4, capacity=16, mesh=mesh)
  cfg = SamplingConfig(greedy=True, max_new_tokens=NEW)
  seen = []  # progress: 0, then each program as it finishes
  n = engine.precompile(
      state,
      [cfg],
      num_stop_ids=1,
      fanout=4,
      progress=lambda done, total: seen.append((done, total)),
  )
  assert n == engine.num_compiles == len(engine.programs_for([cfg]))
  assert seen == [(done, n) for done in range(n + 1)]
  census = CompileCensus()
  census.register("engine", engine)
  _run(engine, state, _requests(SHORT, 2), cfg, stop=[7])
  assert census.counts()["compiles/engine"] == n
  assert census.counts()["compiles/backend_total"] == 0


@pytest.mark.parametrize(
    "agent_map, mesh_shape",
    [("map", None), pytest.param("vmap", (2, 2, 2), marks=pytest.mark.several_devices)],
)
def test_stacked_agents_each_sample_what_they_sample_alone(agent_map, mesh_shape):
  states = [_split(s)[1] for s in (0, 1)]
  mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
  size = {} if mesh is None else dict(slots=4, capacity=16)  # the sharded test's engine
  cfg = SamplingConfig(max_new_tokens=NEW)
  engine = _engine(mesh=mesh, agents=2, agent_map=agent_map, **size)
  requests = [
      Request((a, p), prompt, KEY, [p * 3, p * 3 + 1, p * 3 + 2], agent=a)
      for a, prompts in enumerate([SHORT, SHORT[1:]])
      for p, prompt in enumerate(prompts)
  ]
  out = _run(engine, stack_trees(states), requests, cfg, stop=[7, 9])
  for a in range(2):
    alone = _run(
        _engine(mesh=mesh, **size),
        states[a],
        [Request(r.tag, r.prompt, KEY, r.rows) for r in requests if r.agent == a],
        cfg,
        stop=[7, 9],
    )
    for tag, s in alone.items():
      np.testing.assert_array_equal(out[tag].ids, s.ids)
      np.testing.assert_allclose(out[tag].logprobs, s.logprobs, atol=TOL, rtol=0)
  assert any(
      not np.array_equal(out[((0, p + 1), k)].ids, out[((1, p), k)].ids)
      for p in range(2)
      for k in range(3)
  )  # own weights


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=[]), "empty prompt"),
        (dict(prompt=[1, CFG.vocab_size]), "ids outside"),
        (dict(rows=[0, 1, 2, 3, 4]), "5 samples; allowed: 1 .. 4"),
        (dict(prompt=[1] * 60), "does not fit a slot of 64 columns"),
        (dict(agent=1), "agent 1"),
    ],
)
def test_bad_requests_raise_naming_what_is_wrong(state, kwargs, match):
  engine = _engine()
  engine.start(state, SamplingConfig(max_new_tokens=8), [], PAD, fanout=4)
  args = dict(tag="r", prompt=[1, 2], key=KEY, rows=[0])
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    engine.submit(Request(**args))


def test_bad_runs_and_configs_raise_naming_the_field(state):
  with pytest.raises(ValueError, match="EngineConfig.slots=0"):
    EngineConfig(slots=0, capacity=64)
  with pytest.raises(ValueError, match="EngineConfig.window_buckets"):
    EngineConfig(slots=8, capacity=64, window_buckets=(32,))
  with pytest.raises(ValueError, match=r"EngineConfig.overlap='yes'; allowed: True or False"):
    EngineConfig(slots=8, capacity=64, overlap="yes")
  engine = _engine(slots=2)
  with pytest.raises(ValueError, match="fanout=4"):
    engine.start(state, SamplingConfig(), [], PAD, fanout=4)
  with pytest.raises(ValueError, match="stop_ids"):
    engine.start(state, SamplingConfig(), [CFG.vocab_size], PAD, fanout=1)
  with pytest.raises(ValueError, match="max_new_tokens=70"):
    engine.start(state, SamplingConfig(max_new_tokens=70), [], PAD, fanout=1)


@pytest.mark.parametrize("overlap", [False, True])
def test_slot_shares_count_decoding_and_parked_slots_per_chunk(state, overlap):
  """`occupancy_sum` and `parked_sum` by hand: 16 slots, chunks of 4 steps. Request 0
  (G = 2, 2 tokens) finishes in chunk 1 and its two samples stay parked (not released);
  request 1 (G = 1, 7 tokens) decodes in chunks 1 and 2. Chunk 1: 3 decoding, 0 parked
  (the two park when the chunk is read); chunk 2: 1 decoding, 2 parked. With overlap a
  chunk is read after the next is dispatched: chunk 2 still names the two (3 decoding,
  0 parked), and a third chunk names request 1 (1 decoding, 2 parked)."""
  engine = _engine(overlap=overlap)
  requests = [
      Request(0, PROMPTS[0], KEY, np.arange(2, dtype=np.uint32), max_new=2),
      Request(1, PROMPTS[2], KEY, np.arange(2, 3, dtype=np.uint32), max_new=NEW),
  ]
  out = _run(engine, state, requests, SamplingConfig(max_new_tokens=NEW), release=False)
  assert sorted(out) == [(0, 0), (0, 1), (1, 0)]
  stats = engine.stats
  decoding, parked = ([3, 3, 1], [0, 0, 2]) if overlap else ([3, 1], [0, 2])
  assert stats["chunks"] == len(decoding)
  assert stats["occupancy_sum"] == pytest.approx(sum(decoding) / 16)
  assert stats["parked_sum"] == pytest.approx(sum(parked) / 16)
