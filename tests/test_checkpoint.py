"""Orbax checkpoints: exact round trip, shardings on a mesh, keep-latest-N, keep-best, resume."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax import losses, metrics, sharding, testing
from mtrl_jax.checkpoint import Checkpointer, CheckpointError
from mtrl_jax.train import OptimConfig, TrainState, TrainStep

META = {
    "data": {"position": 12, "seed": 3},
    "curriculum": {"level": 2, "names": ["a", "b"]},
    "best_score": 0.5,
}


@functools.cache
def _trainer(shape=(1, 1, 1)):
  mesh = sharding.make_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])
  model = testing.tiny_model()
  ts = TrainStep(model, losses.LossConfig(), OptimConfig(), mesh)

  def perturb(state, shift):
    def one(x):
      if jnp.issubdtype(x.dtype, jnp.floating):
        return x * 1.5 + 0.25 + shift
      return x + 3 + shift.astype(x.dtype)

    return jax.tree.map(one, state)

  ts.test_perturb = jax.jit(perturb, out_shardings=ts.state_shardings)
  return model, ts


def _state(model, ts, shift=0):
  """A TrainState in which every leaf (step, rng, moments) differs from its init."""
  return ts.test_perturb(ts.init_state(model, seed=5), jnp.int32(shift))


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(tmp_path):
  model, ts = _trainer()
  state = _state(model, ts)
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.all_steps() == []
    assert ckpt.save(7, state, META)
    restored, meta = ckpt.restore(ts.abstract_state())
  assert isinstance(restored, TrainState)
  _assert_equal(restored, state)
  assert meta == META
  assert os.path.isdir(tmp_path / "ckpt" / "7")


@pytest.mark.several_devices
def test_restore_on_mesh_has_the_training_shardings(tmp_path):
  single_model, single = _trainer()
  model, ts = _trainer((2, 2, 2))
  state = _state(model, ts)
  with Checkpointer(str(tmp_path / "mesh")) as ckpt:
    ckpt.save(1, state, META)
    restored, _ = ckpt.restore(ts.abstract_state())
  _assert_equal(restored, state)
  sharded = 0
  for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(ts.state_shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim)
    sharded += not x.sharding.is_fully_replicated
  assert sharded > 0  # FSDP / tensor axes really are split
  # A single-device checkpoint restores straight onto the mesh layout.
  with Checkpointer(str(tmp_path / "single")) as ckpt:
    ckpt.save(1, _state(single_model, single), META)
    moved, _ = ckpt.restore(ts.abstract_state())
  _assert_equal(moved, state)
  for x, want in zip(jax.tree.leaves(moved), jax.tree.leaves(ts.state_shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim)


@pytest.mark.several_devices
def test_a_state_replicated_over_eight_devices_saves_without_compiling_and_reads_back(tmp_path):
  # One process writes every replica's share itself: no per-replica slice programs.
  model, ts = _trainer((8, 1, 1))
  state = jax.block_until_ready(_state(model, ts))
  assert any(
      len(x.sharding.device_set) == 8 and x.sharding.is_fully_replicated
      for x in jax.tree.leaves(state)
  )
  with Checkpointer(str(tmp_path)) as ckpt:
    census = metrics.CompileCensus()
    ckpt.save(1, state, META)
    ckpt.wait()
    assert census.counts()["compiles/backend_total"] == 0
    restored, _ = ckpt.restore(ts.abstract_state())
  _assert_equal(restored, state)


def test_keeps_latest_n_and_resume_finds_the_latest(tmp_path):
  model, ts = _trainer()
  with Checkpointer(str(tmp_path), keep=2) as ckpt:
    for step in range(1, 5):
      assert ckpt.save(step, _state(model, ts, shift=step), {"position": step})
    assert not ckpt.save(4, _state(model, ts), {"position": -1})  # already saved
    assert ckpt.all_steps() == [3, 4]
  with Checkpointer(str(tmp_path), keep=2) as resumed:  # a new process after a kill
    assert resumed.all_steps()[-1] == 4
    state, meta = resumed.restore(ts.abstract_state())
    assert meta == {"position": 4}
    _assert_equal(state, _state(model, ts, shift=4))
    _, meta3 = resumed.restore(ts.abstract_state(), step=3)
    assert meta3 == {"position": 3}


def test_keep_best_keeps_only_the_best(tmp_path):
  model, ts = _trainer()
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.best() is None
    with pytest.raises(CheckpointError, match="no readable best checkpoint under"):
      ckpt.restore_best(ts.abstract_state())
    saved = [
        ckpt.maybe_save_best(step, score, _state(model, ts, shift=step), {"step": step})
        for step, score in [(1, 0.5), (2, 0.3), (3, 0.8), (4, 0.8), (5, 0.6)]
    ]
    assert saved == [True, False, True, False, False]  # ties do not replace the best
    assert ckpt.best() == {"step": 3, "score": 0.8}
    with pytest.raises(ValueError, match="score=nan"):
      ckpt.maybe_save_best(6, float("nan"), _state(model, ts))
  assert sorted(os.listdir(tmp_path / "best")) == ["3"]
  with Checkpointer(str(tmp_path)) as reopened:
    assert reopened.best() == {"step": 3, "score": 0.8}
    state, meta = reopened.restore_best(ts.abstract_state())
  _assert_equal(state, _state(model, ts, shift=3))
  assert meta == {"step": 3, "best_score": 0.8, "best_step": 3}


def test_bad_keep_raises():
  with pytest.raises(ValueError, match="keep=0"):
    Checkpointer("/tmp/unused", keep=0)


def test_async_save_is_safe_against_donating_the_state_right_after(tmp_path):
  # The train step donates its state; a background save must not read buffers
  # that the next step overwrites.
  state = {"a": jnp.arange(2_000_000, dtype=jnp.float32), "b": jnp.ones((500, 500))}
  want = jax.tree.map(np.array, state)
  overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, state, {})
    state = overwrite(overwrite(state))
    restored, _ = ckpt.restore(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    )
  assert float(state["a"][0]) == -7.0
  _assert_equal(restored, want)
