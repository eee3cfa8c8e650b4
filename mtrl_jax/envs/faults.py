"""Fault classification for environments, tools, graders, judges and user simulators.

Every error raised while an environment reacts to the policy is caught by the
framework (`mtrl_jax.envs.runner.step_environment`), classified into a
`FaultKind`, counted and logged with the trajectory. What happens next depends
on who caused it (docs/design.md invariant 7):

  model_format    the policy's text could not be parsed (malformed tool call,
                  missing answer tag). Model-caused: may be penalised.
  tool_error      a well-formed call the tool rejected (unknown tool, wrong or
                  missing arguments, a `ToolError` raised by the tool).
                  Model-caused: may be penalised.
  contract        environment, tool or grader code broke the API: react_to
                  returned the wrong shape or type (a 3-tuple, None, a
                  non-thread), a grade is NaN or infinite, a factory or a fork
                  failed, a task is not a mapping, or the code raised a
                  programming error (see the rule below). Not retried (the
                  same code fails the same way); the sample is masked.
  infrastructure  something outside the code failed: a service, a connection,
                  the disk, a crashed judge, an unknown exception. Retried,
                  then the sample is masked out of the update.
  timeout         a tool or environment call ran past its time limit:
                  infrastructure too (an overloaded tool says nothing about
                  the policy), so the step is masked. `FaultPolicy(
                  tool_timeout='tell')` (config `env.tool_timeout`) keeps a
                  timed-out tool call as an error turn the policy reads and
                  the trajectory goes on, unmasked and unpenalised.
  truncation      the framework stopped the trajectory at its turn cap or
                  token budget.

Contract, infrastructure and timeout faults are never scored as reward.

The rule for an exception (`classify`): an `EnvFault` subclass
(`ModelFormatError`, `ToolError`, `ContractError`, `InfrastructureError`,
`FaultTimeoutError`) carries its kind; the text package's `ToolCallError` is
model_format; `TimeoutError` is timeout; any other `OSError` (ConnectionError,
BrokenPipeError, FileNotFoundError, ...) is infrastructure; the programming
errors `CONTRACT_ERRORS` (TypeError, AttributeError, LookupError (KeyError,
IndexError), NameError, ValueError, ArithmeticError, AssertionError,
NotImplementedError, RecursionError, ImportError) are contract; anything else
(RuntimeError, MemoryError, a library's own exception) is infrastructure.
Code that talks to a service should wrap the service's failures in
`InfrastructureError` (the judges and user simulators do), so a malformed
reply is retried rather than taken for a bug.

The first fault of each (kind, source) is printed once on the console of the
process that writes files (`mtrl_jax.envs.fault_report.show_fault_once`);
every fault is counted in `faults/<kind>` and kept in the rollout dump.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import queue
import threading
from typing import Any, Callable, Iterable, Optional


class FaultKind(str, enum.Enum):
  """Who or what caused a fault; the string value is what gets logged."""

  MODEL_FORMAT = "model_format"
  TOOL_ERROR = "tool_error"
  CONTRACT = "contract"
  INFRASTRUCTURE = "infrastructure"
  TIMEOUT = "timeout"
  TRUNCATION = "truncation"

  @classmethod
  def parse(cls, value) -> "FaultKind":
    """`FaultKind` from a member or its string value; clear error otherwise."""
    if isinstance(value, cls):
      return value
    try:
      return cls(value)
    except ValueError:
      raise ValueError(f"fault kind {value!r}; allowed: {[k.value for k in cls]}") from None


# Model-caused kinds: the only ones a reward may penalise.
MODEL_CAUSED = frozenset({FaultKind.MODEL_FORMAT, FaultKind.TOOL_ERROR})
# Kinds that are always masked: no honest reward exists.
ALWAYS_MASKED = frozenset({FaultKind.CONTRACT, FaultKind.INFRASTRUCTURE})
# Plain exceptions that mean a bug in environment, tool or grader code (`classify`).
CONTRACT_ERRORS = (
    TypeError,
    AttributeError,
    LookupError,
    NameError,
    ValueError,
    ArithmeticError,
    AssertionError,
    NotImplementedError,
    RecursionError,
    ImportError,
)
# What a timed-out tool call does to its step (`FaultPolicy.tool_timeout`).
TOOL_TIMEOUT_MODES = ("mask", "tell")


class EnvFault(Exception):
  """Base of the exceptions an environment raises to name a fault's kind."""

  kind: FaultKind = FaultKind.INFRASTRUCTURE


class ModelFormatError(EnvFault):
  """The policy's output could not be parsed (penalisable)."""

  kind = FaultKind.MODEL_FORMAT


class ToolError(EnvFault):
  """A tool rejected a call because of its arguments (penalisable).

  Raise it from a tool for an error the policy can fix ("unknown city"); the
  message is shown to the policy in the tool turn.
  """

  kind = FaultKind.TOOL_ERROR


class ContractError(EnvFault):
  """Environment, tool or grader code broke the API (masked, never retried)."""

  kind = FaultKind.CONTRACT


class InfrastructureError(EnvFault):
  """A failure that is not the policy's fault (retried, then masked)."""

  kind = FaultKind.INFRASTRUCTURE


class FaultTimeoutError(EnvFault, TimeoutError):
  """A tool or environment call ran past its time limit."""

  kind = FaultKind.TIMEOUT


def classify(exc: BaseException) -> FaultKind:
  """The `FaultKind` of an arbitrary exception (the rule in the module docstring).

  `EnvFault` subclasses carry their kind; the text package's `ToolCallError`
  (a malformed tool call) is a model format error; `TimeoutError` is a
  timeout; other `OSError`s are infrastructure; `CONTRACT_ERRORS` are
  contract; everything else is infrastructure. No kind but the model-caused
  ones is ever turned into (negative) reward.
  """
  if isinstance(exc, EnvFault):
    return exc.kind
  if type(exc).__name__ == "ToolCallError":
    # Matched by name so that this module does not import mtrl_jax.text.
    return FaultKind.MODEL_FORMAT
  if isinstance(exc, TimeoutError):
    return FaultKind.TIMEOUT
  if isinstance(exc, OSError):
    return FaultKind.INFRASTRUCTURE
  if isinstance(exc, CONTRACT_ERRORS):
    return FaultKind.CONTRACT
  return FaultKind.INFRASTRUCTURE


@dataclasses.dataclass(frozen=True)
class Fault:
  """One recorded fault.

  Attributes:
    kind: the classification.
    source: what raised it: 'environment', 'tool:<name>', 'grader', 'judge',
      'user_sim', 'framework'.
    message: a human-readable description (shown in logs, sometimes to the policy).
    retries: how many retries were spent before giving up (infrastructure).
    where: the code it came from, e.g. 'MyEnv.react_to (my_env.py:12)' ('' when
      unknown).
  """

  kind: FaultKind
  source: str
  message: str
  retries: int = 0
  where: str = ""

  def __post_init__(self):
    object.__setattr__(self, "kind", FaultKind.parse(self.kind))

  @classmethod
  def from_exception(
      cls, exc: BaseException, source: str, retries: int = 0, where: str = ""
  ) -> "Fault":
    msg = str(exc) or type(exc).__name__
    if not isinstance(exc, EnvFault):
      msg = f"{type(exc).__name__}: {msg}"
    return cls(classify(exc), source, msg, retries, where)

  def to_dict(self) -> dict:
    out = {
        "kind": self.kind.value,
        "source": self.source,
        "message": self.message,
        "retries": self.retries,
    }
    if self.where:
      out["where"] = self.where
    return out

  def console_line(self, max_chars: int = 400) -> str:
    """The one line `fault_report.show_fault_once` prints."""
    where = f" in {self.where}" if self.where else ""
    message = " ".join(self.message.split())
    if len(message) > max_chars:
      message = message[:max_chars] + " ..."
    return (
        f"fault {self.kind.value} from {self.source}{where}: {message}  "
        f"(shown once; counted in faults/{self.kind.value})"
    )


@dataclasses.dataclass(frozen=True)
class FaultPolicy:
  """What the framework does with each kind of fault.

  Attributes:
    penalise: kinds counted as invalid calls for the tool-validity penalty;
      only model-caused kinds are allowed here.
    mask: kinds that mask the sample out of the update; after construction
      it also holds 'contract' (always) and 'timeout' when
      `tool_timeout='mask'`.
    max_retries: retries of an environment step that failed with an
      infrastructure fault before it is masked.
    tool_timeout: 'mask' (default): a step with a timeout fault (a tool call
      past its `timeout_s`, or one the environment reports) is masked: never
      rewarded, never penalised, its branch ends. 'tell': the policy reads
      the "timed out" tool turn and the trajectory goes on, the step scored
      as usual (no penalty: timeouts are not model-caused). A react_to call
      past `StepLimits.react_timeout_s` is masked in both modes (the
      environment's state is unknown).
  """

  penalise: frozenset = MODEL_CAUSED
  mask: frozenset = ALWAYS_MASKED
  max_retries: int = 2
  tool_timeout: str = "mask"

  def __post_init__(self):
    if self.tool_timeout not in TOOL_TIMEOUT_MODES:
      raise ValueError(
          f"FaultPolicy.tool_timeout={self.tool_timeout!r} (config "
          f"env.tool_timeout); allowed: {list(TOOL_TIMEOUT_MODES)}"
      )
    penalise = frozenset(FaultKind.parse(k) for k in self.penalise)
    mask = frozenset(FaultKind.parse(k) for k in self.mask)
    if FaultKind.TIMEOUT in mask and self.tool_timeout == "tell":
      raise ValueError(
          "FaultPolicy.mask contains 'timeout' but tool_timeout='tell'; "
          "use tool_timeout='mask' to mask timeouts"
      )
    mask |= {FaultKind.CONTRACT}
    if self.tool_timeout == "mask":
      mask |= {FaultKind.TIMEOUT}
    bad = penalise - MODEL_CAUSED
    if bad:
      raise ValueError(
          f"FaultPolicy.penalise={sorted(k.value for k in penalise)}: only model-caused kinds "
          f"may be penalised; allowed: {sorted(k.value for k in MODEL_CAUSED)}"
      )
    if FaultKind.INFRASTRUCTURE not in mask:
      raise ValueError(
          "FaultPolicy.mask must contain 'infrastructure': infrastructure "
          "faults are never scored as reward"
      )
    if self.max_retries < 0:
      raise ValueError(f"FaultPolicy.max_retries={self.max_retries}; must be >= 0")
    object.__setattr__(self, "penalise", penalise)
    object.__setattr__(self, "mask", mask)


class FaultCounter:
  """Counts faults by kind (and by source) over one RL step or one run."""

  def __init__(self):
    self.by_kind: collections.Counter = collections.Counter()
    self.by_source: collections.Counter = collections.Counter()

  def add(self, fault: Fault) -> None:
    self.by_kind[fault.kind] += 1
    self.by_source[fault.source] += 1

  def add_all(self, faults: Iterable[Fault]) -> None:
    for f in faults:
      self.add(f)

  def merge(self, other: "FaultCounter") -> None:
    self.by_kind.update(other.by_kind)
    self.by_source.update(other.by_source)

  def count(self, kind: Optional[FaultKind] = None) -> int:
    """Faults of one kind, or all faults when `kind` is None."""
    if kind is None:
      return sum(self.by_kind.values())
    return self.by_kind[FaultKind.parse(kind)]

  def reset(self) -> None:
    self.by_kind.clear()
    self.by_source.clear()

  def metrics(self, prefix: str = "faults/") -> dict[str, int]:
    """Every kind (zeros included, so curves are continuous) plus the total."""
    out = {f"{prefix}{k.value}": self.by_kind[k] for k in FaultKind}
    out[f"{prefix}total"] = self.count()
    return out

  def __repr__(self):
    body = ", ".join(f"{k.value}={v}" for k, v in sorted(self.by_kind.items()) if v)
    return f"FaultCounter({body})"


class _TimedWorkers:
  """Daemon threads that run timed calls, reused across calls.

  A thread started per call made a calculator environment step cost 0.35 ms
  against 0.24 ms with pooled workers on a quiet 2-core machine, and 1.2 ms
  against 0.2-0.3 ms with both cores busy (benchmarks/bench_env.py; inline,
  without the guard, the step is 0.16 ms). A worker stuck past its timeout
  is simply not idle: the next call starts another worker, and the stuck one
  rejoins the idle list if its call ever returns.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._idle: list[queue.SimpleQueue] = []
    self.started = 0  # worker threads started so far

  def submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, dict]:
    """Runs `fn()` on an idle worker (a new one if none is idle); returns
    (an event set when it finished, the box its 'result' or 'error' lands in)."""
    done, box = threading.Event(), {}
    with self._lock:
      inbox = self._idle.pop() if self._idle else None
      if inbox is None:
        self.started += 1
    if inbox is None:
      inbox = queue.SimpleQueue()
      threading.Thread(
          target=self._work, args=(inbox,), daemon=True, name=f"timed-call-{self.started}"
      ).start()
    inbox.put((fn, done, box))
    return done, box

  def _work(self, inbox: queue.SimpleQueue):
    while True:
      fn, done, box = inbox.get()
      try:
        box["result"] = fn()
      except BaseException as e:  # re-raised by the caller, in its own thread
        box["error"] = e
      with self._lock:
        self._idle.append(inbox)  # idle before the caller wakes: it may call again at once
      done.set()


_WORKERS = _TimedWorkers()


def call_with_timeout(fn: Callable, timeout_s: Optional[float], what: str, /, *args, **kwargs):
  """`fn(*args, **kwargs)` in a daemon worker thread, waiting at most `timeout_s`.

  Exceptions raised by `fn` are re-raised in the caller's thread. Python
  threads cannot be killed: after a timeout the worker is abandoned (it is a
  daemon, so it never blocks interpreter exit) and `FaultTimeoutError` is
  raised. Workers are pooled (`_TimedWorkers`), so a call costs a hand-off,
  not a thread start. `timeout_s=None` calls `fn` inline.
  """
  if timeout_s is None:
    return fn(*args, **kwargs)
  done, box = _WORKERS.submit(lambda: fn(*args, **kwargs))
  if not done.wait(timeout_s):
    raise FaultTimeoutError(f"{what} timed out after {timeout_s:g}s")
  if "error" in box:
    raise box["error"]
  return box["result"]
