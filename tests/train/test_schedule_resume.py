"""The learning-rate schedule as an argument of the train step: a resume with another
`rl.steps` recompiles nothing and its rate continues the cosine (`train.optim`). The
precompiled run it resumes also checks that nothing compiles after the warm-up.

References are numpy float64 values of the stretched cosine as docs/design.md
defines it, and optax's own AdamW on `optax.warmup_cosine_decay_schedule`.
"""

import dataclasses
import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import calculator as calc_config
from mtrl_jax import losses, models
from mtrl_jax.run import experiment, rl
from mtrl_jax.train import (
    OptimConfig,
    SFTObjective,
    StepConfig,
    make_sft_step,
    optim,
    pack_sft_rows,
)
from mtrl_jax.train.frozen_agents import PartlyFrozenTrainStep
from mtrl_jax.train.stacked import StackedTrainStep

FAST = (("xla_backend_optimization_level", 0),)  # LLVM -O0: same program, faster compile
PEAK = 1e-3
# float32 1 + cos(pi * phase) near phase 1 loses ~1e-7 of the peak to cancellation.
ATOL = 1e-7 * PEAK


def _cosine(phase):
  """peak * (1 + cos(pi * phase)) / 2 in float64: the cosine at a phase in [0, 1]."""
  return PEAK * 0.5 * (1.0 + np.cos(np.pi * phase))


def _applied_rates(schedule, warmup, totals):
  """The rate each update applies (read off `scale_by_run_schedule`'s scaled unit
  gradient) and the rate `optim.learning_rate` reports before it, the run's total
  for update i being `totals[i]`; and how many times the update was traced."""
  cfg = OptimConfig(
      learning_rate=PEAK, warmup_steps=warmup, total_steps=totals[0], schedule=schedule
  )
  traces = []

  @jax.jit
  def update(state, args):
    traces.append(1)
    tx = optim.scale_by_run_schedule(cfg, args)
    reported = optim.learning_rate(state, cfg, args)
    scaled, new = tx.update({"w": jnp.ones((), jnp.float32)}, state)
    return new, -scaled["w"], reported

  state = optim.scale_by_run_schedule(cfg).init(None)
  applied, reported = [], []
  for total in totals:
    args = optim.schedule_args(dataclasses.replace(cfg, total_steps=total))
    state, a, r = update(state, args)
    applied.append(float(a))
    reported.append(float(r))
  return np.asarray(applied), np.asarray(reported), len(traces)


def test_a_longer_total_stretches_the_rest_of_the_cosine_from_the_same_rate():
  # Warm-up 2, total 10, 6 updates; then total 18. At count 6 the phase is
  # (6 - 2) / (10 - 2) = 1/2 (rate peak / 2); from there it runs linearly to 1 at
  # count 18: phase(c) = 1/2 + (1/2) (c - 6) / 12, e.g. 3/4 at count 12, where the
  # rate is peak (1 - sqrt(2) / 2) / 2. Past 18 the rate stays 0.
  applied, reported, traces = _applied_rates("cosine", 2, [10] * 6 + [18] * 14)
  want = [0.0, PEAK / 2] + [_cosine((c - 2) / 8) for c in range(2, 6)]
  want += [_cosine(0.5 + 0.5 * (c - 6) / 12) for c in range(6, 18)] + [0.0, 0.0]
  np.testing.assert_allclose(applied, want, rtol=1e-6, atol=ATOL)
  np.testing.assert_array_equal(reported, applied)  # the metric is the applied rate
  assert applied[6] == pytest.approx(PEAK / 2, rel=1e-6)  # no jump at the resume
  assert applied[12] == pytest.approx(PEAK * (1 - np.sqrt(2) / 2) / 2, rel=1e-6)
  assert traces == 1  # the total is an argument: one program for every total


def test_a_shorter_total_and_a_second_change_continue_from_the_anchor():
  # Total 10 (no warm-up), 5 updates: phase c / 10. At count 5 the total becomes 7:
  # phase 1/2 + (1/2) (c - 5) / 2. At count 6 (phase 3/4) it becomes 14:
  # phase 3/4 + (1/4) (c - 6) / 8, which reaches 1 at count 14.
  applied, _, _ = _applied_rates("cosine", 0, [10] * 5 + [7] + [14] * 9)
  want = (
      [_cosine(c / 10) for c in range(5)]
      + [_cosine(0.5)]
      + [_cosine(0.75 + 0.25 * (c - 6) / 8) for c in range(6, 14)]
      + [0.0]
  )
  np.testing.assert_allclose(applied, want, rtol=1e-6, atol=ATOL)


def test_a_total_changed_in_the_warmup_or_after_the_cosine_ended_takes_the_new_curve():
  # In the warm-up (count 1 of 2) the rate is peak c / 2 whatever the total; the
  # cosine then starts at count 2 over the new total 6: phase (c - 2) / 4.
  applied, _, _ = _applied_rates("cosine", 2, [4] + [6] * 5)
  want = [0.0, PEAK / 2] + [_cosine((c - 2) / 4) for c in range(2, 6)]
  np.testing.assert_allclose(applied, want, rtol=1e-6, atol=ATOL)
  # Total 4 run to its end (count 4, rate 0), then 8: there is no rate to go on from,
  # so the new total's own curve from count 4: phase (4 - 2) / 6 = 1/3, rate 3/4 peak.
  applied, _, _ = _applied_rates("cosine", 2, [4] * 4 + [8] * 4)
  want = [0.0, PEAK / 2] + [_cosine((c - 2) / 2) for c in (2, 3)]
  want += [_cosine((c - 2) / 6) for c in range(4, 8)]
  np.testing.assert_allclose(applied, want, rtol=1e-6, atol=ATOL)
  assert applied[4] == pytest.approx(0.75 * PEAK, rel=1e-6)
  # The constant schedule ignores the total.
  applied, _, _ = _applied_rates("constant", 2, [3] * 2 + [9] * 3)
  np.testing.assert_allclose(applied, [0.0, PEAK / 2, PEAK, PEAK, PEAK], rtol=1e-6)


# ---------------------------------------------------------------- the train step


def _sft_rows():
  """Four 12-token rows (3 context, 9 trained) of random ids."""
  r = np.random.RandomState(0)
  vocab = models.get_preset("tiny").vocab_size
  return [(r.randint(1, vocab, 12).tolist(), [False] * 3 + [True] * 9) for _ in range(4)]


def _sft_batch():
  return pack_sft_rows(_sft_rows(), (16,))


@pytest.mark.slow  # SFT updates against optax's, step by step (~15 s on 2 cores)
def test_an_unchanged_run_updates_as_optax_adamw_on_warmup_cosine_decay(tiny_model):
  """Three SFT updates (rates 0, peak, peak / 2) equal a plain loop of optax's AdamW on
  `optax.warmup_cosine_decay_schedule`, with the NLL computed from the model directly."""
  cfg = OptimConfig(
      learning_rate=PEAK,
      warmup_steps=1,
      total_steps=3,
      schedule="cosine",
      eps=1e-4,
      weight_decay=0.01,
      grad_clip_norm=1.0,
  )
  step = make_sft_step(tiny_model, cfg, step_cfg=StepConfig(compiler_options=FAST))
  batch = _sft_batch()
  state = step.init_state(tiny_model)
  rates = []
  for _ in range(3):
    state, m = step(state, None, batch)
    rates.append(step.fetch_metrics(m)["learning_rate"])
  np.testing.assert_allclose(rates, [0.0, PEAK, PEAK / 2], rtol=1e-6, atol=ATOL)

  graphdef, params = nnx.split(tiny_model, nnx.Param)
  tokens = jnp.asarray([ids for ids, _ in _sft_rows()], jnp.int32)
  mask = jnp.asarray([trained for _, trained in _sft_rows()])

  def nll(p):
    logp = losses.token_logprobs(nnx.merge(graphdef, p)(tokens), tokens)
    return -jnp.sum(jnp.where(mask, logp, 0.0)) / mask.sum()

  def reference(schedule):
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=lambda ps: jax.tree.map(lambda x: x.ndim >= 2, ps),
        ),
    )

    @functools.partial(jax.jit, compiler_options=dict(FAST))
    def run(p):
      opt = tx.init(p)
      for _ in range(3):
        updates, opt = tx.update(jax.grad(nll)(p), opt, p)
        p = optax.apply_updates(p, updates)
      return p

    return [np.asarray(x) for x in jax.tree.leaves(run(params))]

  want = reference(optax.warmup_cosine_decay_schedule(0.0, PEAK, 1, 3, 0.0))
  got = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # The comparison tells schedules apart: the constant rate moves the weights elsewhere.
  other = reference(
      optax.join_schedules([optax.constant_schedule(0.0), optax.constant_schedule(PEAK)], [1])
  )
  assert max(np.abs(g - o).max() for g, o in zip(got, other)) > 1e-4


def _update_text(step, batch, *extra):
  """The update program of `step` for `batch` as StableHLO text (lowered, not compiled)."""
  inner = getattr(step, "inner", step)
  sel = step._select(batch)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  with jax.set_mesh(step.mesh), nnx.logical_axis_rules(inner.rules):
    return (
        step._fn_for(sel, True)
        .lower(step.abstract_state(), None, jax.tree.map(sds, sel), inner.schedule_args, *extra)
        .as_text()
    )


def test_the_update_programs_do_not_hold_the_schedule_numbers(tiny_model):
  """Another total, peak rate and warm-up give the same program: plain, stacked (per-agent
  rates) and partly frozen steps alike."""
  a = OptimConfig(learning_rate=PEAK, warmup_steps=1, total_steps=3, schedule="cosine")
  b = OptimConfig(learning_rate=3 * PEAK, warmup_steps=4, total_steps=40, schedule="cosine")
  batch = _sft_batch()
  step_cfg = StepConfig(compiler_options=FAST)
  plain = [_update_text(make_sft_step(tiny_model, c, step_cfg=step_cfg), batch) for c in (a, b)]
  assert plain[0] == plain[1]
  batch_A = jax.tree.map(lambda x: np.stack([x, x]), batch)
  for make in (
      lambda c: StackedTrainStep(
          tiny_model, SFTObjective(), c, [c.learning_rate, 2 * c.learning_rate], step_cfg=step_cfg
      ),
      lambda c: PartlyFrozenTrainStep(
          tiny_model, SFTObjective(), c, [c.learning_rate] * 2, [True, False], step_cfg=step_cfg
      ),
  ):
    texts = []
    for c in (a, b):
      step = make(c)
      texts.append(_update_text(step, batch_A, step.scales))
    assert texts[0] == texts[1]


# ---------------------------------------------------------------- a resumed run


class _CacheLog(logging.Handler):
  """JAX's persistent compilation cache hits and misses, by module name."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.hits, self.misses = [], []

  def emit(self, record):
    text = record.getMessage()
    for prefix, found in (
        ("Persistent compilation cache hit for ", self.hits),
        ("PERSISTENT COMPILATION CACHE MISS for ", self.misses),
    ):
      if text.startswith(prefix):
        found.append(text[len(prefix) :].split("'")[1])


def _smoke(steps):
  c = calc_config.get_config("smoke=True")
  c.rl.steps = steps
  c.optim.schedule, c.optim.warmup_steps = "cosine", 1
  c.rl.precompile = True  # every train program before step 1: the resume's warm-up
  # One length bucket and one root per step keep the program count small (3 train-step
  # programs: one row bucket, three logit buckets).
  c.rl.length_buckets = (256,)
  c.rl.roots_per_step = 1
  c.sft.steps = 0  # no warm-up: not what this test is about
  c.sft.mix_every = 2  # SFT steps mixed into RL compile with the rest
  return c


@pytest.mark.several_devices
@pytest.mark.slow
def test_precompiled_run_compiles_nothing_after_warmup_and_resumes_at_its_rate_from_the_cache(
    tmp_path, capsys
):
  """A 4-step run stopped after step 2: docs/design.md invariant 5, every shape bucket
  compiles before step 1 and none after, the console counting them as they compile.
  Resumed with rl.steps=6: every train-step program loads from the persistent
  compilation cache (none compiles), nothing compiles after the warm-up, and the logged
  rate goes on from the old run's value."""
  workdir = str(tmp_path / "run")
  config = _smoke(4)
  exp = experiment.start(config)  # the schedule's total: 4 updates; the loop stops at 2
  summary = rl.train(
      dataclasses.replace(exp, rl=dataclasses.replace(exp.rl, steps=2)),
      config,
      workdir,
      progress=False,
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  pre = summary["precompile"]
  assert pre["engine_programs"] > 0 and pre["train_programs"] == 3
  assert "sft_mix/nll" in rows[2] and "sft_mix/nll" not in rows[1]
  for r in rows[1:]:
    assert r["compiles/after_warmup"] == 0, r
    assert r["compiles/train_step"] == pre["train_programs"]
    assert r["compiles/sft_mix_step"] == 1
  assert summary["compiles"]["compiles/after_warmup"] == 0
  err = capsys.readouterr().err.splitlines()
  n = pre["engine_programs"]
  said = [l.split(" (")[0] for l in err if l.startswith(("compil", "rl:"))]
  # First and last of each kind (a kind that takes 15 s or more says how far it got).
  ends = lambda kind: [[l for l in said if kind in l][i] for i in (0, -1)]
  assert ends(" engine ") == [
      f"compiling {n} engine programs",
      f"compiled {n}/{n} engine programs",
  ], err
  assert ends(" train-step ") == [
      "compiling 3 train-step programs",
      "compiled 3/3 train-step programs",
  ], err
  assert said[-1] == "rl: steps 1-2, held-out evaluation every 2 steps", err
  # The train-step programs compile on a thread of their own from before the warm-up
  # (`shapes.TrainCompile`), the engine's after it.
  assert said.index("compiling 3 train-step programs") < said.index(ends(" engine ")[0])

  logger, cache = logging.getLogger("jax._src.compiler"), _CacheLog()
  level = logger.level
  logger.setLevel(logging.DEBUG)
  logger.addHandler(cache)
  try:
    rl.run(_smoke(6), workdir, progress=False)
  finally:
    logger.removeHandler(cache)
    logger.setLevel(level)
  train_programs = lambda names: [n for n in names if n.endswith("_step")]
  assert train_programs(cache.hits)  # the resume's train step went through the cache
  assert not train_programs(cache.misses), cache.misses
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = {r["step"]: r for r in map(json.loads, f)}
  assert sorted(rows) == list(range(7))
  for step in (3, 4, 5, 6):
    assert rows[step]["compiles/after_warmup"] == 0, rows[step]
  for step in range(1, 7):  # every update applied: update `step` ran at count step - 1
    assert rows[step]["train/skipped"] == rows[step]["train/empty_batch"] == 0
  # Warm-up 1, total 4: counts 0 and 1 at rates 0 and peak. Resumed at count 2, the
  # phase (2 - 1) / 3 = 1/3 runs to 1 at the new total 6: 1/3 + (2/3) (c - 2) / 4.
  peak = config.optim.learning_rate
  cos = lambda phase: peak * 0.5 * (1.0 + np.cos(np.pi * phase))
  want = [0.0, peak] + [cos(1 / 3 + (2 / 3) * (c - 2) / 4) for c in (2, 3, 4, 5)]
  got = [rows[step]["train/learning_rate"] for step in range(1, 7)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * peak)
  # No jump: step 3 runs at the 4-step schedule's rate at count 2 (3/4 peak), not at
  # the 6-step curve's (phase 1/5).
  assert got[2] == pytest.approx(0.75 * peak, rel=1e-6)
  assert abs(got[2] - cos(1 / 5)) > 0.1 * peak
