"""Where environment steps run: a thread pool in the engine's process, or worker processes.

`StepWorkers(mode, max_concurrency, transition)` (config `env.workers`,
`env.max_concurrency`) is built once per run and handed to every
`expand_tree` call (training rollouts and evaluation); `close` shuts it down
at the end of the run.

  threads    (default) each step runs on a pool thread of the engine's process
             (`step_action` on the transition itself): parsing, tools, grading,
             rendering and tokenising share the interpreter lock with the
             engine's scheduling loop.
  processes  each step runs in a pool of worker processes (`spawn` context: no
             process with JAX initialised is ever forked). The transition
             (renderers, limits, reward config) goes to each worker once, by the
             pool's initializer; per step the state (`EnvState`: the branch's
             environment and threads) and the completions go there pickled, and
             the outcome (next state included) comes back pickled, with the
             renderers' re-tokenisation counters of the step, which the
             engine's renderers add up. Each step works on its own copy of the
             state, so whatever an environment keeps in a `SharedResource` stays
             in the worker; `close(state)` runs on the engine's copy.

Refusals and faults under `processes`:
  * a state or completion that cannot be pickled masks the step with a
    contract fault naming `env.workers` (shown once). The run's start-up check
    (`run.checks`) pickles the first task's root state and refuses the run in
    one line first; text generators that sample on the engine (`LocalLLM`,
    `BatchingGenerator`: LLM judges, LLM user simulators) refuse to be pickled,
    so an environment holding one is refused there;
  * a worker that dies (killed, `os._exit`, out of memory) breaks the pool:
    every step in flight on it comes back masked with an infrastructure fault
    (source 'framework', not retried: the step may be what killed it), the pool
    is replaced by a fresh one, and the rollout goes on;
  * a fault or notice a worker sees is kept, not printed, and comes back with
    the step: the engine's process shows it, once per run however many
    workers saw it (`FaultConsole.keep_lines`).

`max_concurrency` (>= 1; 0: unbounded) caps the environment steps in flight in
both modes (the engine queues the rest in order of readiness); it also sizes
the pool (threads: 32 when unbounded; processes: one per CPU when unbounded).
It counts joint actions, whatever the number of agents. The cap and the seeds
(`inflight.action_seed`, passed with each step) leave the tree unchanged.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional

from mtrl_jax.envs.fault_report import FAULT_CONSOLE, show_fault_once
from mtrl_jax.envs.faults import Fault, FaultKind
from mtrl_jax.rollout.records import ActionOutcome, StepRecord

WORKER_MODES = ("threads", "processes")
DEFAULT_THREADS = 32


def step_action(transition, state, comps, kw: dict, last: bool, may_continue: bool, num_turns):
  """One environment step; at the last turn a step that goes on past the tree is graded
  as ended there (`Transition.cut`). Runs on a pool thread or in a worker process."""
  out = transition.step(state, comps, **kw)
  if last and isinstance(out, ActionOutcome) and out.next_state is not None:
    if out.step.valid and not (may_continue and out.step.continues_turn):
      out = transition.cut(out, num_turns)
  return out


def masked_outcome(kind: FaultKind, message: str) -> ActionOutcome:
  """A masked, ended step that records one fault of `kind` (shown once): a contract
  fault is the environment's (it does not pickle), an infrastructure one the framework's."""
  source = "environment" if kind == FaultKind.CONTRACT else "framework"
  fault = Fault(kind, source, message, where="env.workers")
  show_fault_once(fault)
  return ActionOutcome(None, StepRecord(0.0, valid=False, faults=(fault,), details={}))


def _renderers(transition) -> list:
  """The transition's renderers, each once, in a fixed order."""
  return list({id(r): r for r in getattr(transition, "renderers", ())}.values())


def _counts(renderers) -> list:
  return [{k: v for k, v in r.metrics().items() if not k.endswith("_rate")} for r in renderers]


# ------------------------------------------------------------------ the worker side
_WORKER: dict = {}


def _init_worker(transition) -> None:
  """Runs once in each worker process: keeps the run's transition. JAX (imported with
  the package) stays on the CPU, so a worker never claims the accelerator."""
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  FAULT_CONSOLE.keep_lines()  # the engine's process shows them (`StepWorkers.outcome`)
  _WORKER["transition"], _WORKER["renderers"] = transition, _renderers(transition)


def _worker_step(payload: bytes, kw: dict, last: bool, may_continue: bool, num_turns: int):
  """One step in a worker process: (pickled outcome, per renderer its counter deltas, the
  console lines of the faults and notices it saw first)."""
  transition, renderers = _WORKER["transition"], _WORKER["renderers"]
  before = _counts(renderers)
  state, comps = pickle.loads(payload)
  out = step_action(transition, state, comps, kw, last, may_continue, num_turns)
  try:
    data = pickle.dumps(out)
  except Exception as e:  # an environment that cannot cross back: the step is masked
    if out.next_state is not None and hasattr(transition, "close"):
      transition.close(out.next_state)
    data = pickle.dumps(masked_outcome(FaultKind.CONTRACT, unpicklable_message("outcome", e)))
  after = _counts(renderers)
  deltas = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
  return data, deltas, FAULT_CONSOLE.take_lines()


def unpicklable_message(what: str, exc: BaseException) -> str:
  """The one line of a step whose `what` (state, outcome) cannot be pickled."""
  cause = " ".join(str(exc).split()) or type(exc).__name__
  return (
      f"env.workers='processes' ships each step's {what} to a worker process by pickle, "
      f"and it cannot be pickled ({type(exc).__name__}: {cause}); allowed: picklable "
      "environments, or env.workers='threads'"
  )


# ------------------------------------------------------------------ the engine side
def usable_cpus() -> int:
  """CPUs this process may run on (its affinity mask: `taskset`, a cgroup cpuset), which can
  be fewer than the machine's `os.cpu_count()`."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # no affinity call on this platform (macOS)
    return os.cpu_count() or 1


class StepWorkers:
  """The run's pool of environment-step workers (see the module docstring).

  Args:
    mode: 'threads' or 'processes' (config `env.workers`).
    max_concurrency: most steps in flight, >= 1; 0: unbounded.
    transition: the run's transition (required for 'processes': each worker
      gets it once; every step must then be of this transition).
    executor: 'threads' only: an executor of the caller's to run steps on
      (not shut down by `close`).
  """

  def __init__(
      self,
      mode: str = "threads",
      max_concurrency: int = 0,
      transition: Any = None,
      *,
      executor: Optional[concurrent.futures.Executor] = None,
  ):
    check_workers(mode, max_concurrency)
    if mode == "processes" and transition is None:
      raise ValueError("StepWorkers(mode='processes') needs the run's transition")
    if mode == "processes" and executor is not None:
      raise ValueError("StepWorkers(mode='processes') makes its own pool; executor must be None")
    self.mode, self.max_concurrency, self.transition = mode, max_concurrency, transition
    self._renderers = _renderers(transition)  # in the order the workers count them
    self._executor, self._own = executor, executor is None
    self._lock = threading.Lock()
    self.replaced = 0  # pools replaced after a worker died
    default = DEFAULT_THREADS if mode == "threads" else usable_cpus()
    self.size = max_concurrency or default

  def _pool(self) -> concurrent.futures.Executor:
    with self._lock:
      if self._executor is None:
        if self.mode == "threads":
          self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.size)
        else:
          self._executor = concurrent.futures.ProcessPoolExecutor(
              max_workers=self.size,
              mp_context=multiprocessing.get_context("spawn"),
              initializer=_init_worker,
              initargs=(self.transition,),
          )
      return self._executor

  def submit(self, transition, state, comps, kw, last, may_continue, num_turns):
    """Starts one step; `outcome(future)` reads it once done."""
    if self.mode == "threads":
      args = (transition, state, comps, kw, last, may_continue, num_turns)
      return self._pool().submit(step_action, *args)
    if transition is not self.transition:
      raise ValueError("env.workers='processes': the step's transition is not the pool's")
    try:
      payload = pickle.dumps((state, comps))
    except Exception as e:  # masked; the start-up check refuses such a run earlier
      future = concurrent.futures.Future()
      masked = masked_outcome(FaultKind.CONTRACT, unpicklable_message("state", e))
      future.set_result((pickle.dumps(masked), [], []))  # as a worker's: no counts, no lines
      return future
    pool = self._pool()
    try:
      future = pool.submit(_worker_step, payload, kw, last, may_continue, num_turns)
    except BrokenProcessPool:  # broken by a step that finished meanwhile
      future = concurrent.futures.Future()
      future.set_exception(BrokenProcessPool("the pool broke before the step started"))
    future.pool = pool
    return future

  def outcome(self, future) -> ActionOutcome:
    """The step's outcome; under 'processes' a dead worker's step comes back masked (an
    infrastructure fault) and its pool is replaced."""
    if self.mode == "threads":
      return future.result()
    try:
      result = future.result()
    except BrokenProcessPool as e:
      self._replace(getattr(future, "pool", None))
      return masked_outcome(
          FaultKind.INFRASTRUCTURE,
          f"an environment worker process died during the step (env.workers='processes': "
          f"{' '.join(str(e).split())}); the step is masked and the pool replaced",
      )
    data, deltas, lines = result
    for renderer, delta in zip(self._renderers, deltas):
      renderer.add_counts(delta)
    for key, line in lines:  # each worker shows a line once; this console, once per run
      FAULT_CONSOLE.notice(key, line)
    return pickle.loads(data)

  def _replace(self, broken) -> None:
    """A fresh pool in place of `broken` (once, however many of its steps failed)."""
    with self._lock:
      if broken is None or broken is not self._executor:
        return
      self._executor = None
      self.replaced += 1
    broken.shutdown(wait=False, cancel_futures=True)

  def close(self) -> None:
    """Shuts the pool down (waits for steps in flight); a later step starts a new one."""
    with self._lock:
      pool, self._executor = self._executor, None
    if pool is not None and self._own:
      pool.shutdown(wait=True)


def check_workers(mode: str, max_concurrency: int) -> None:
  """Refuses a bad `env.workers` / `env.max_concurrency` in one line naming the field."""
  if mode not in WORKER_MODES:
    raise ValueError(f"config env.workers={mode!r}; allowed: {list(WORKER_MODES)}")
  if (
      isinstance(max_concurrency, bool)
      or not isinstance(max_concurrency, int)
      or max_concurrency < 0
  ):
    raise ValueError(
        f"config env.max_concurrency={max_concurrency!r}; allowed: an int >= 1, or 0 (unbounded)"
    )
