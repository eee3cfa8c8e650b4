"""SFT warm-up: masked cross-entropy, packing, batcher resume, TFDS source, overfitting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models
from mtrl_jax.rollout.train_batch import from_rows
from mtrl_jax.train import (
    OptimConfig,
    SFTBatcher,
    SFTObjective,
    StepConfig,
    make_sft_step,
    pack_sft_rows,
)

CFG = models.get_preset("tiny")
FAST = (("xla_backend_optimization_level", 0),)  # LLVM -O0: same program, faster compile


def _row(n, start, seed):
  """`n` tokens; the first `start` are context (a prompt), the rest trainable."""
  ids = np.random.RandomState(seed).randint(1, CFG.vocab_size, n)
  return ids.tolist(), [False] * start + [True] * (n - start)


def _rows_batch(mask_BxL, row_weight_B):
  """A `TrainBatch` of rows with this loss mask (tokens irrelevant to the objective)."""
  mask_BxL = np.asarray(mask_BxL, bool)
  return from_rows(
      np.zeros(mask_BxL.shape, np.int32),
      mask_BxL,
      row_weight_B=row_weight_B,
      num_logits=mask_BxL.shape[1],
  )


def test_objective_matches_hand_worked_example():
  # Row 0 trains positions 1, 2 (logp -1, -2): 3 over 2 tokens. Row 1 trains
  # positions 2, 3 (logp -4, -8): 12. Loss = (3 + 12) / 4 = 3.75; with row 1 a
  # padding row (weight 0) only row 0 counts: 3 / 2 = 1.5. Trained tokens sit
  # in the first K slots of their row, in order.
  logp_BxK = jnp.array([[-1.0, -2.0, 0.0, 0.0], [-4.0, -8.0, 0.0, 0.0]])
  mask = [[0, 1, 1, 0], [0, 0, 1, 1]]
  num, den, _ = SFTObjective().terms(logp_BxK, None, None, _rows_batch(mask, [1.0, 1.0]))
  assert float(num) / float(den) == 3.75
  num, den, sums = SFTObjective().terms(logp_BxK, None, None, _rows_batch(mask, [1.0, 0.0]))
  assert float(num) / float(den) == 1.5 and float(sums["rows"]) == 1


def test_masked_positions_get_zero_gradient():
  mask = np.array([[1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0]], bool)  # position 0 forced off
  batch = _rows_batch(mask, [1.0, 1.0])
  trained = batch.loss_mask_BxK
  assert trained.sum() == 5  # (0, 1), (0, 3), (1, 2), (1, 3), (1, 4)
  logp = jnp.where(trained, -1.5, jnp.nan)  # anything at empty slots, NaN included

  def loss(lp):
    num, den, _ = SFTObjective().terms(lp, None, None, batch)
    return num / den

  value, grad = jax.value_and_grad(loss)(logp)
  assert float(value) == pytest.approx(1.5)
  np.testing.assert_array_equal(np.asarray(grad)[~trained], 0.0)
  np.testing.assert_allclose(np.asarray(grad)[trained], -1.0 / trained.sum(), rtol=1e-7)


def test_pack_sft_rows_shapes_and_errors():
  rows = [_row(5, 2, 0), _row(9, 3, 1), ({"ids": [4, 5, 6], "trainable": [0, 1, 1]})]
  batch = pack_sft_rows(rows, length_buckets=(8, 16), pad_id=0, num_rows=4)
  assert batch.shape == (4, 16, 16) and batch.tokens_BxL.dtype == np.int32
  np.testing.assert_array_equal(batch.row_weight_B, [1, 1, 1, 0])
  np.testing.assert_array_equal(batch.tokens_BxL[1, :9], rows[1][0])
  assert batch.tokens_BxL[1, 9:].tolist() == [0] * 7
  assert batch.loss_mask_BxK.sum(1).tolist() == [3, 6, 2, 0]
  # Each trained token is scored from its predecessor's position.
  np.testing.assert_array_equal(batch.prev_BxK[1, :6], [2, 3, 4, 5, 6, 7])
  np.testing.assert_array_equal(batch.target_BxK[1, :6], rows[1][0][3:])
  assert pack_sft_rows(rows, (16,), row_multiple=8).shape == (8, 16, 16)
  with pytest.raises(ValueError, match="position 0 is trainable"):
    pack_sft_rows([([1, 2], [True, True])], (8,))
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    pack_sft_rows([_row(20, 2, 0)], (8, 16))
  with pytest.raises(ValueError, match="equal-length"):
    pack_sft_rows([([1, 2, 3], [False, True])], (8,))
  with pytest.raises(ValueError, match="num_rows=2"):
    pack_sft_rows(rows, (16,), num_rows=2)


def test_batcher_is_deterministic_and_resumes():
  rows = [_row(4 + i, 2, i) for i in range(10)]
  a = SFTBatcher(rows, batch_size=4, length_buckets=(16,), seed=3)
  seen = [next(a) for _ in range(3)]
  first_epoch = {tuple(t[t > 0]) for b in seen[:2] for t in b.tokens_BxL}
  first_epoch |= {tuple(t[t > 0]) for t in seen[2].tokens_BxL[:2]}
  assert first_epoch == {tuple(r[0]) for r in rows}  # 10 rows, each once per epoch
  state = a.get_state()
  want = next(a)
  b = SFTBatcher(rows, batch_size=4, length_buckets=(16,), seed=3)
  b.set_state(state)
  got = next(b)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  with pytest.raises(ValueError, match="seed"):
    SFTBatcher(rows, 4, (16,), seed=4).set_state(state)


@functools.cache
def _sft_rows_builder_class():
  """A TFDS builder of `{"ids", "trainable"}` rows from Python generators (array_record)."""
  import tensorflow_datasets as tfds  # heavy; only this test needs it

  class SftRows(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    # No download, so no checksums file beside the code; looking for one makes
    # tfds 4.9 import the `importlib_resources` backport, absent here.
    code_path = None

    def __init__(self, *, splits, **kwargs):
      self._splits = dict(splits)
      super().__init__(**kwargs)

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict(
              {
                  "ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                  "trainable": tfds.features.Tensor(shape=(None,), dtype=np.bool_),
              }
          ),
      )

    def _split_generators(self, dl_manager):
      del dl_manager
      return {name: self._generate_examples(fn) for name, fn in self._splits.items()}

    def _generate_examples(self, fn):
      for i, (ids, trainable) in enumerate(fn()):
        yield i, {"ids": np.asarray(ids, np.int32), "trainable": np.asarray(trainable, bool)}

  return SftRows


def _sft_rows_builder(data_dir, splits=None):
  """The builder under `data_dir`; `splits` (name -> rows callable) only to build it."""
  return _sft_rows_builder_class()(
      splits=splits or {}, data_dir=data_dir, file_format="array_record"
  )


def test_tfds_source_round_trip(tmp_path):
  """SFTBatcher reads a TFDS data source (array_record, random access, no TensorFlow)."""
  rows = [_row(4 + i, 2, i) for i in range(6)]
  builder = _sft_rows_builder(str(tmp_path), {"train": lambda: iter(rows)})
  builder.download_and_prepare()
  source = _sft_rows_builder(str(tmp_path)).as_data_source("train")  # read-only reopen
  assert len(source) == len(rows)
  got = {(tuple(e["ids"].tolist()), tuple(e["trainable"].tolist())) for e in source}
  assert got == {(tuple(i), tuple(m)) for i, m in rows}
  batch = next(SFTBatcher(source, batch_size=6, length_buckets=(16,), shuffle=False))
  assert batch.loss_mask_BxK.sum() == sum(sum(m) for _, m in rows)


@functools.cache
def _sft(lr):
  model = models.create_model(CFG, seed=0)
  step = make_sft_step(
      model,
      OptimConfig(learning_rate=lr, grad_clip_norm=1.0),
      step_cfg=StepConfig(compiler_options=FAST),
  )
  return model, step


def test_step_loss_equals_numpy_float64_cross_entropy():
  rows = [_row(7, 3, 0), _row(12, 1, 1), _row(10, 6, 2)]
  batch = pack_sft_rows(rows, (24,), num_rows=4)  # the overfit test's bucket: one compile
  model, step = _sft(1e-2)
  graphdef, params = nnx.split(model, nnx.Param)
  logits = np.asarray(
      jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, batch.tokens_BxL), np.float64
  )
  # log p(tokens[t] | tokens[:t]) from the logits at t - 1, in float64.
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = 0.0
  count = 0
  for b, (ids, trainable) in enumerate(rows):
    for t in range(1, len(ids)):
      if trainable[t]:
        nll += logz[b, t - 1] - logits[b, t - 1, ids[t]]
        count += 1
  want = nll / count
  state = step.init_state(model)
  state, metrics = step(state, None, batch)
  m = step.fetch_metrics(metrics)
  assert m["tokens"] == count == 4 + 11 + 4
  # float32 log-softmax and a 19-token float32 sum: a few ulps (~1e-7 relative).
  np.testing.assert_allclose(m["loss"], want, rtol=1e-6)
  np.testing.assert_allclose(m["nll"], want, rtol=1e-6)


def test_tiny_model_overfits_a_few_sequences():
  rows = [_row(24, 4, 10 + i) for i in range(4)]
  model, step = _sft(1e-2)
  state = step.init_state(model)
  compiles = step.num_compiles  # 0, or 1 if the cross-entropy test ran first
  data = SFTBatcher(rows, batch_size=4, length_buckets=(24,), seed=0)
  losses_seen = []
  for _ in range(50):
    state, metrics = step(state, None, next(data))
    losses_seen.append(step.fetch_metrics(metrics)["loss"])
  assert step.num_compiles == max(compiles, 1)  # one bucket, compiled once
  # Memorised: from ~25 nats per token (a peaked random init) to < 0.1.
  assert losses_seen[-1] < 0.1 and losses_seen[-1] < 0.01 * losses_seen[0], losses_seen
