"""The sharded, jitted train step: state, shardings, one program per shape bucket.

State is a plain pytree, `TrainState(step, params, opt_state, rng,
num_skipped)`, with `params` the `nnx.State` of the model's `nnx.Param`s
(`graphdef, params = nnx.split(model, nnx.Param)`) and optax applied to it
directly. We use this functional form rather than `nnx.Optimizer`: a pytree
state takes explicit `in_shardings`/`out_shardings`, donation and Orbax
`StandardSave` as is, and the graphdef stays a static closure, so new weights
never retrace.

What is optimised is an `Objective` (`mtrl_jax.train.objectives`): exact
(num, den) terms plus summable metrics. The update itself (forward, exact
micro-batch accumulation, AdamW, the non-finite skip) is
`mtrl_jax.train.update.one_update`; here it is jitted with the state donated.
The schedule's numbers (`optim.ScheduleArgs`) are an argument of the programs,
not constants: a resume with another `rl.steps` recompiles nothing (`train.optim`).

With adapters (`model.cfg.lora`, `mtrl_jax.models.lora`) `params` and AdamW's state are
the adapters'; the frozen base (`TrainStep.base`), an argument of every program, is with
the adapters off the KL reference: a run keeps no reference copy.

Metrics come back as a dict of device scalars. The loops fetch them with
`TrainStep.fetch_metrics` right after the update that produced them: the RL
loop after a step's last update (with several updates on one batch the
earlier ones' are never fetched), the SFT warm-up at its logged steps only.
`fetch_metrics` raises under `nonfinite='halt'` when the fetched update was
skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtrl_jax import losses, models, sharding
from mtrl_jax.models import lora as lora_lib
from mtrl_jax.train import optim
from mtrl_jax.rollout.train_batch import TrainBatch
from mtrl_jax.train.forward import forward_logprobs, forward_values
from mtrl_jax.train.compile import lower_step
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.update import one_update

_NONFINITE = ("skip", "halt")


@flax.struct.dataclass
class TrainState:
  """Everything the update changes; one pytree, donated to the step.

  Attributes:
    step: int32, train-step calls so far (skipped ones included).
    params: `nnx.State` of the policy's `nnx.Param`s.
    opt_state: optax state of `make_optimizer`.
    rng: uint32[2] base key of the run; the loop derives per-step keys with
      `jax.random.fold_in(rng, step)` so a resumed run replays the stream.
    num_skipped: int32, updates skipped because the loss or gradient was not finite.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  num_skipped: jax.Array


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """How the step runs (not what it optimises).

  Attributes:
    num_microbatches: the batch is split into this many micro-batches along
      rows (B must be divisible by it); gradients are accumulated exactly.
    nonfinite: 'skip' (keep params, count it) or 'halt' (also raise when the
      metrics are fetched) on a non-finite loss or gradient.
    logprob_chunk_size: if set, logprobs come from the final hidden states one vocabulary
      chunk at a time, never materialising [B, L, V] logits (no entropy metric then).
    report_entropy: report the policy's mean token entropy on trained tokens.
    compiler_options: XLA options for compiling the step, as (name, value) pairs, e.g.
      (("xla_backend_optimization_level", 0),) halves CPU compile time in tests.
  """

  num_microbatches: int = 1
  nonfinite: str = "skip"
  logprob_chunk_size: Optional[int] = None
  report_entropy: bool = True
  compiler_options: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if (
        not isinstance(self.num_microbatches, int)
        or isinstance(self.num_microbatches, bool)
        or self.num_microbatches < 1
    ):
      raise ValueError(
          f"StepConfig.num_microbatches={self.num_microbatches!r}; allowed: an integer >= 1"
      )
    if self.nonfinite not in _NONFINITE:
      raise ValueError(f"StepConfig.nonfinite={self.nonfinite!r}; allowed: {list(_NONFINITE)}")
    if self.logprob_chunk_size is not None and (
        not isinstance(self.logprob_chunk_size, int) or self.logprob_chunk_size < 1
    ):
      raise ValueError(
          f"StepConfig.logprob_chunk_size={self.logprob_chunk_size!r}; "
          "allowed: None or an integer >= 1"
      )
    if not all(
        isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)
        for o in self.compiler_options
    ):
      raise ValueError(
          f"StepConfig.compiler_options={self.compiler_options!r}; allowed: a "
          "tuple of (xla_option_name, value) pairs"
      )


class NonFiniteError(FloatingPointError):
  """A train step met a non-finite loss or gradient under nonfinite='halt'."""


class TrainStep:
  """A jitted, sharded update of `TrainState` by one objective.

  Args:
    model: the policy model (its graph and parameter shardings are used;
      its weights are taken by `init_state`).
    objective: a `PolicyObjective`, an SFT objective, or a `LossConfig`
      (wrapped in `PolicyObjective`).
    optim_cfg: optimizer configuration.
    mesh: the training mesh (default: one device).
    step_cfg: micro-batching, non-finite policy, logprob chunking.
    rules: logical-axis rules for the parameters.
  """

  def __init__(
      self,
      model: models.Transformer,
      objective,
      optim_cfg: optim.OptimConfig,
      mesh=None,
      step_cfg: StepConfig = StepConfig(),
      rules=sharding.TRAIN_RULES,
  ):
    if isinstance(objective, losses.LossConfig):
      objective = PolicyObjective(objective)
    self.objective = objective
    self.model_cfg: models.ModelConfig = model.cfg
    self.optim_cfg = optim_cfg
    self.step_cfg = step_cfg
    self.mesh = mesh if mesh is not None else sharding.single_device_mesh()
    self.rules = sharding.rules_for(self.model_cfg, self.mesh, rules)
    lora = self.model_cfg.lora
    self.lora = lora if lora is not None and lora.enabled else None
    self.base = self.base_shardings = None  # with adapters: the frozen base and its layout
    self.graphdef, params, *base = (
        lora_lib.split(model) if self.lora else nnx.split(model, nnx.Param)
    )
    self.ref_graphdef = (
        lora_lib.base_graphdef(self.model_cfg, rules) if self.lora else self.graphdef
    )
    if self.lora:
      self.base_shardings = models.state_shardings(
          base[0], lora_lib.plain(self.model_cfg), self.mesh, rules
      )
      self.base, self._fresh_adapters = jax.device_put(base[0], self.base_shardings), params
    self.tx = optim.make_optimizer(optim_cfg)  # the state's layout; the programs build their own
    self.schedule_args = optim.schedule_args(optim_cfg)  # an argument of every update program
    self.param_shardings = models.state_shardings(params, self.model_cfg, self.mesh, rules)
    rep = sharding.replicated(self.mesh)
    abstract_opt = jax.eval_shape(self._init_opt, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        self.tx,
        lambda _, s: s,
        abstract_opt,
        self.param_shardings,
        transform_non_params=lambda _: rep,
    )
    self.state_shardings = TrainState(
        step=rep, params=self.param_shardings, opt_state=opt_shardings, rng=rep, num_skipped=rep
    )
    self._abstract_params = jax.eval_shape(lambda p: p, params)
    self._abstract_opt = abstract_opt
    self._jitted: dict[Any, Any] = {}
    self._init_fn = self._copy_fn = self._merge_fn = None
    self._num_traces = 0

  # ------------------------------------------------------------ state
  def _init_opt(self, params):
    # Optimizer moments are float32 whatever the parameter dtype (bf16 moments
    # lose small updates, and updates arrive in float32 anyway, so bf16 moments
    # would also change dtype after the first step and force a recompile).
    return self.tx.init(
        jax.tree.map(
            lambda p: p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else p, params
        )
    )

  def init_state(self, model_or_params, seed: int = 0, adapters=None) -> TrainState:
    """A fresh TrainState (step 0, zero Adam moments) born sharded; with adapters the
    given weights become the base (`models.lora.adapters_and_base`) and a plain model or
    weights start from `adapters` (`model.lora.init_from`; None: fresh, B zero)."""
    params = self.start_params(model_or_params, adapters)
    if self._init_fn is None:

      def init(params, key):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self._init_opt(params),
            rng=key,
            num_skipped=jnp.zeros((), jnp.int32),
        )

      self._init_fn = jax.jit(init, out_shardings=self.state_shardings)
    return self._init_fn(params, jax.random.PRNGKey(seed))

  def start_params(self, model_or_params, adapters=None):
    """The trained parameters a state starts from, laid out as the step's: with adapters
    the given weights become the base and the adapters start from `adapters` (None:
    fresh), else the model's (or the given) parameters."""
    params = model_or_params
    if self.lora is not None:
      params, base = lora_lib.adapters_and_base(
          model_or_params, self._fresh_adapters if adapters is None else adapters
      )
      self.set_base(base)
    elif isinstance(model_or_params, nnx.Module):
      params = nnx.state(model_or_params, nnx.Param)
    return jax.device_put(params, self.param_shardings)

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the target of a checkpoint restore."""

    def sds(x, s):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=self._abstract_params,
        opt_state=self._abstract_opt,
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        num_skipped=jax.ShapeDtypeStruct((), jnp.int32),
    )
    return jax.tree.map(sds, abstract, self.state_shardings)

  def copy_params(self, params):
    """A separate sharded copy (e.g. the frozen reference: state.params is donated)."""
    if self._copy_fn is None:
      self._copy_fn = jax.jit(
          lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings
      )
    return self._copy_fn(params)

  def set_base(self, base) -> None:
    """The frozen base the adapters adapt (a restored one, say), laid out as the step's."""
    self.base = jax.device_put(base, self.base_shardings)

  def merged(self, params):
    """The plain model's parameters of `params`: with adapters the base with
    W + scale * A @ B merged in (what sampling and export read), else `params`."""
    if self.lora is None:
      return params
    if self._merge_fn is None:
      self._merge_fn = jax.jit(
          lambda b, a: lora_lib.merge(b, a, self.lora), out_shardings=self.base_shardings
      )
    return self._merge_fn(self.base, params)

  def frozen_arg(self, ref_params, needs_ref: bool):
    """The step's second argument: the base with adapters (always: the forward
    reads it), else the reference parameters when the objective needs them."""
    if self.lora is not None:
      return self.base
    if needs_ref and ref_params is None:
      raise ValueError(
          "the objective needs reference logprobs (kl_coef > 0) but ref_params is None"
      )
    return ref_params if needs_ref else None

  # ------------------------------------------------------------ step
  @property
  def num_compiles(self) -> int:
    """Traces (= compilations) of the step so far: one per batch shape bucket."""
    return self._num_traces

  def _batch_shardings(self, batch: TrainBatch):
    return jax.tree.map(
        lambda v: sharding.batch_sharding(self.mesh, len(v.shape), v.shape[0]), batch
    )

  def _select(self, batch: TrainBatch, rows_axis: int = 0) -> TrainBatch:
    """`batch` checked (token ids, micro-batch rows, what the objective reads), without
    the fields the objective does not read; `rows_axis` 1 for agent-stacked batches
    (`train.stacked`)."""
    if not isinstance(batch, TrainBatch):
      raise TypeError(
          f"train batch is a {type(batch).__name__}; allowed: rollout.train_batch.TrainBatch"
      )
    check = getattr(self.objective, "check", None)
    if check is not None:
      check(batch)
    if not getattr(self.objective, "recompute_old", False):
      batch = batch.replace(trainer_old_logp_BxK=None)
    tokens = batch.tokens_BxL
    if (
        isinstance(tokens, np.ndarray)
        and tokens.size
        and (tokens.min() < 0 or tokens.max() >= self.model_cfg.vocab_size)
    ):
      # jnp.take would silently return NaN rows for out-of-range ids.
      raise ValueError(
          f"tokens_BxL ids span [{tokens.min()}, {tokens.max()}]; allowed: "
          f"[0, vocab_size={self.model_cfg.vocab_size})"
      )
    b = np.shape(tokens)[rows_axis]
    m = self.step_cfg.num_microbatches
    if b % m:
      raise ValueError(f"batch rows B={b} not divisible by StepConfig.num_microbatches={m}")
    return batch

  def __call__(self, state: TrainState, ref_params, batch: TrainBatch):
    """One update. `state` is donated; `ref_params` may be None unless needed.

    Args:
      state: the current TrainState (its buffers are donated).
      ref_params: frozen reference parameters (same graph), used when the
        objective needs reference logprobs (kl_coef > 0); else ignored.
      batch: a `TrainBatch` of host or device arrays.
    Returns:
      (new_state, metrics): metrics a dict of device scalars.
    """
    batch = self._select(batch)
    frozen = self.frozen_arg(ref_params, self.objective.needs_ref)
    fn = self._fn_for(batch, not self.objective.needs_ref)
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      return fn(state, frozen, batch, self.schedule_args)

  def old_logprobs(self, params, batch: TrainBatch) -> TrainBatch:
    """`batch` with `trainer_old_logp_BxK`: the trainer's own logprobs at `params`
    (no gradient), which `PolicyObjective(recompute_old=True)` reads; the RL loop
    adds them before the first of several updates on one batch."""
    fwd = batch.forward_part()
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      old = self._old_fn_for(fwd)(params, self.base, fwd)
    return batch.replace(trainer_old_logp_BxK=old)

  def values(self, params, batch: TrainBatch):
    """A critic's values [B, K] of `batch` at `params` (no gradient): the value head
    at `value_pos_BxK`, from one forward of the packed batch (the rollout's value pass)."""
    fwd = batch.forward_part().replace(value_pos_BxK=batch.value_pos_BxK)
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      return self._values_fn_for(fwd)(params, fwd)

  def _values_fn_for(self, fwd: TrainBatch):
    key = ("values",) + fwd.program_key()
    if key not in self._jitted:
      self._jitted[key] = jax.jit(
          self._values,
          in_shardings=(self.param_shardings, self._batch_shardings(fwd)),
          out_shardings=sharding.batch_sharding(self.mesh, 2, fwd.tokens_BxL.shape[0]),
      )
    return self._jitted[key]

  def _values(self, params, fwd):
    self._num_traces += 1
    return jax.lax.stop_gradient(forward_values(self.graphdef, params, fwd))

  def _old_fn_for(self, fwd: TrainBatch):
    key = ("old_logprobs",) + fwd.program_key()
    fn = self._jitted.get(key)
    if fn is None:
      rows = fwd.tokens_BxL.shape[0]
      fn = jax.jit(
          self._old_logp,
          in_shardings=(self.param_shardings, self.base_shardings, self._batch_shardings(fwd)),
          out_shardings=sharding.batch_sharding(self.mesh, 2, rows),
      )
      self._jitted[key] = fn
    return fn

  def _old_logp(self, params, base, fwd):
    """Traced body of `old_logprobs` (also mapped over agents by `train.stacked`);
    `base` the frozen base with adapters, else None."""
    self._num_traces += 1
    full = params if base is None else nnx.merge_state(params, base)
    logp, _, _ = forward_logprobs(
        self.graphdef,
        full,
        fwd,
        self.step_cfg.logprob_chunk_size,
        False,
        getattr(self.objective, "temperature", 1.0),
    )
    return jax.lax.stop_gradient(logp)

  def _fn_for(self, batch: TrainBatch, no_ref: bool):
    # Shardings depend on the row count only; jax.jit's own cache adds one
    # executable per length bucket.
    key = (no_ref,) + batch.program_key()
    fn = self._jitted.get(key)
    if fn is None:
      frozen = self.base_shardings if self.lora else None if no_ref else self.param_shardings
      in_sh = (
          self.state_shardings,
          frozen,
          self._batch_shardings(batch),
          sharding.replicated(self.mesh),
      )
      fn = jax.jit(
          functools.partial(self._step, with_ref=not no_ref),
          in_shardings=in_sh,
          out_shardings=(self.state_shardings, sharding.replicated(self.mesh)),
          donate_argnums=(0,),
          compiler_options=dict(self.step_cfg.compiler_options) or None,
      )
      self._jitted[key] = fn
    return fn

  def precompile(self, batch: TrainBatch, with_ref: Optional[bool] = None) -> None:
    """Compiles the step for this batch's shapes without running it.

    `batch` may hold arrays or `jax.ShapeDtypeStruct`s (see
    `rollout.train_batch.batch_spec`). A later call with a batch of the same
    shapes and dtypes reuses the program (jax.jit's cache), so a training loop
    can compile all its shape buckets before the first step.
    `with_ref` defaults to whether the objective needs reference logprobs.
    """
    for lowered in self.lower(batch, with_ref):
      lowered.compile()

  def lower(self, batch: TrainBatch, with_ref: Optional[bool] = None) -> list:
    """`precompile`'s programs lowered, not yet compiled (`train.compile.lower_step`)."""
    return lower_step(
        self,
        batch,
        with_ref,
        self.rules,
        lambda shape: sharding.batch_sharding(self.mesh, 2, shape[0]),
        self.schedule_args,
    )

  def _step(
      self, state: TrainState, frozen, batch, schedule_args, update_scale=None, *, with_ref: bool
  ):
    """One update, traced (`train.update.one_update`); `frozen` is `frozen_arg`'s
    (the base with adapters, else the reference or None); `schedule_args` the
    schedule's numbers (`optim.ScheduleArgs`); `update_scale` (a scalar, default 1)
    multiplies the optimizer's updates (`train.stacked`)."""
    self._num_traces += 1  # runs once per trace, i.e. per compilation
    base = frozen if self.lora else None
    ref = frozen if with_ref else None
    return one_update(
        state,
        ref,
        batch,
        graphdef=self.graphdef,
        objective=self.objective,
        step_cfg=self.step_cfg,
        optim_cfg=self.optim_cfg,
        schedule_args=schedule_args,
        mesh=self.mesh,
        param_shardings=self.param_shardings,
        update_scale=update_scale,
        frozen=base,
        ref_graphdef=self.ref_graphdef,
    )

  def fetch_metrics(self, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Host floats of a step's metrics; raises NonFiniteError under 'halt'."""
    out = {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}
    if self.step_cfg.nonfinite == "halt" and out.get("skipped", 0.0) > 0:
      raise NonFiniteError(
          f"train step {int(out.get('step', -1))}: non-finite loss={out.get('loss')} or "
          f"grad_norm={out.get('grad_norm')}; the update was skipped and "
          "StepConfig.nonfinite='halt' stops the run (use 'skip' to continue)"
      )
    return out
