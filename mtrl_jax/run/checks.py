"""Start-up checks that build something: what a config names must work before compute.

`experiment.build` calls these once, after every group's own fields are valid
and before any model is built. Each refusal is one `ValueError` naming the
field, its value and what is allowed (`experiment.validate` turns it into a
`ConfigError`):

  check_lora           what low-rank adapters cannot be combined with, and that
                       `model.lora.init_from` fits the base;
  check_imports        the SFT conversations and tokenizer specials resolve;
  make_tokenizer       the tokenizer loads (a checkpoint's tokenizer.json);
  check_environment    the factory and both task splits build, their first
                       tasks are metadata mappings, one environment from the
                       first train task has `tree.num_agents` agents, its
                       rendered first prompt (system prompt with tool
                       schemas) plus `sampling.max_new_tokens` fits
                       `env.max_tokens`, and it and its initial threads
                       fork (tree rollouts fork them at every branch), and
                       with `env.workers='processes'` its root state pickles;
                       returns the factory;
  check_microbatches   `step.num_microbatches` divides every planned train
                       batch (`run/shapes.plan_shapes`) and the SFT batch;
  check_curriculum     the task source serves every curriculum level;
  success_threshold    `eval.success_threshold`, resolved from the factory's
                       `outcome_range` when unset, refused when no outcome
                       (or every outcome) passes it.

`advisories` names what runs but is probably not meant (off-policy rollouts
left uncorrected, adapters as wide as the model, a cross tree far wider than
the step's roots): one line each, printed once at start (`experiment.start`)
as `warning: ...`.
"""

from __future__ import annotations

import inspect
import math
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mtrl_jax.envs import ContractError, fork_error_message, resolve_factory
from mtrl_jax.registry import import_object
from mtrl_jax.rollout import workers as workers_lib
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.run import builders
from mtrl_jax.run.config import success_threshold_for

if TYPE_CHECKING:
  from mtrl_jax.run.experiment import Experiment

SAMPLE_TASKS = 4  # leading tasks of each split checked to be metadata mappings


class _Resolving:
  """Turns an error while resolving user code into one `ValueError` naming the field.

  `what` is the field and its value ("env.factory='x'"); `allowed` is added
  unless the underlying message already lists what is allowed.
  """

  def __init__(self, what: str, allowed: str):
    self.what, self.allowed = what, allowed

  def __enter__(self):
    return self

  def __exit__(self, kind, err, tb):
    if kind is None or not issubclass(
        kind, (ValueError, TypeError, ImportError, AttributeError, LookupError, OSError)
    ):
      return False
    msg = str(err) if kind is ValueError else f"{kind.__name__}: {err}"
    if "allowed" not in msg and "registered" not in msg:
      msg += f"; allowed: {self.allowed}"
    raise ValueError(f"config {self.what}: {msg}") from err


def check_lora(exp: Experiment) -> None:
  """What low-rank adapters (`model.lora.rank` > 0) cannot be combined with, refused in
  one line (validation calls it): the frozen base is the KL reference and every agent's;
  `model.lora.init_from` must fit the base (`export_lora.check_adapters`, tensors unread)
  and the base must be the one it was trained over (no warm-up changes it)."""
  lora = exp.model.lora
  if not lora.enabled:
    return
  for field, value, why in (
      ("rl.ref_reset_every", exp.rl.ref_reset_every, "the reference is the frozen base"),
      ("sft.mix_every", exp.sft.mix_every, "SFT mix steps train every weight"),
      ("agents.paths", exp.agents.paths, "the agents' adapters share one base"),
  ):
    if any(value) if isinstance(value, tuple) else value:
      raise ValueError(
          f"config {field}={value!r} with model.lora.rank={lora.rank}: "
          f"{why}; allowed: 0 / empty, or model.lora.rank=0"
      )
  if not lora.init_from:
    return
  if exp.sft.steps:
    raise ValueError(
        f"config sft.steps={exp.sft.steps} with model.lora.init_from="
        f"{lora.init_from!r}: the warm-up trains the base the adapters were "
        "fitted to; allowed: sft.steps=0, or model.lora.init_from=''"
    )
  from mtrl_jax.train import export_lora  # reads the adapters' headers (jax, safetensors
  from mtrl_jax.train.policies import agent_labels

  labels = [] if exp.agents.share_policy else agent_labels(exp.tree.num_agents)
  for path in dict.fromkeys(export_lora.init_dirs(lora.init_from, labels)):
    export_lora.check_adapters(path, exp.model.arch.replace(lora=lora))


def check_imports(exp: Experiment):
  """Resolves the import paths the run will call later (SFT data, tokenizer specials)."""
  if exp.sft.conversations:
    with _Resolving(
        f"sft.conversations={exp.sft.conversations!r}",
        "'pkg.module:fn' with fn(task) -> [(role, content), ...]",
    ):
      fn = import_object(exp.sft.conversations, "sft.conversations")
      if not callable(fn):
        raise TypeError(f"{fn!r} is not callable")
    kwargs = dict(exp.sft.conversation_kwargs)
    with _Resolving(
        f"sft.conversation_kwargs={kwargs}", f"keyword arguments of {exp.sft.conversations}"
    ):
      inspect.signature(fn).bind(None, **kwargs)
  tok = exp.tokenizer
  if tok.kind == "byte" and tok.extra_specials:
    with _Resolving(
        f"tokenizer.extra_specials={tok.extra_specials!r}",
        "'pkg.module:NAME' naming a tuple of strings",
    ):
      specials = import_object(tok.extra_specials, "tokenizer.extra_specials")
      if isinstance(specials, str) or not all(isinstance(x, str) for x in specials):
        raise TypeError(f"{specials!r} is not a tuple of strings")


def make_tokenizer(exp: Experiment):
  """The run's tokenizer (a checkpoint's tokenizer.json must load): built once here,
  for the prompt check and the vocabulary fit."""
  with _Resolving(
      f"tokenizer.kind={exp.tokenizer.kind!r} with model.path={exp.model.path!r}",
      "a checkpoint directory holding its tokenizer.json",
  ):
    return builders.make_tokenizer(exp.tokenizer, exp.model.path)


def check_environment(exp: Experiment, tokenizer):
  """Builds the factory (and the graders or experts its kwargs name), both task
  splits and one environment from the first train task; checks its agent count,
  its first prompt's length and its fork (see the module docstring). Returns the
  factory.

  Runs before any model is built, so a wrong factory, task source, agent count,
  token budget or unforkable environment fails in one line instead of at (or
  silently after) the first rollout.
  """
  env, tasks = exp.env, exp.tasks
  with _Resolving(
      f"env.factory={env.factory!r} (env.kwargs={dict(env.kwargs)})",
      "a registered name or 'pkg.module:Factory' taking env.kwargs",
  ):
    factory = resolve_factory(env.factory, **dict(env.kwargs))
  sources = {}
  for field, split in (
      ("tasks.train_split", tasks.train_split),
      ("tasks.eval_split", tasks.eval_split),
  ):
    with _Resolving(
        f"tasks.source={tasks.source!r} with {field}={split!r}",
        "a registered name or 'pkg.module:fn(split, **tasks.kwargs)' serving that split",
    ):
      source = sources[field] = builders.make_task_source(tasks, split)
      if len(source) == 0:
        raise ValueError("the split has no tasks")
      for i in range(min(SAMPLE_TASKS, len(source))):
        if not isinstance(source[i], Mapping):
          raise TypeError(
              f"task {i} is a {type(source[i]).__name__}, not a mapping of "
              "task metadata (what the factory's create_environment takes)"
          )
  task = dict(sources["tasks.train_split"][0], task_index=0)
  with _Resolving(
      f"env.factory={env.factory!r} on the first task of tasks.source={tasks.source!r}",
      "a factory whose environments take these tasks",
  ):
    environment = factory.create_environment(task)
  try:
    n = getattr(environment, "num_agents", 1)
    declared = getattr(factory, "num_agents", None)
    if declared is not None and declared != n:
      raise ValueError(
          f"config env.factory={env.factory!r}: the factory declares "
          f"num_agents={declared} but its environments have {n}; allowed: equal "
          "counts (fix the factory)"
      )
    if n != exp.tree.num_agents:
      raise ValueError(
          f"config tree.num_agents={exp.tree.num_agents}; the environments of "
          f"env.factory={env.factory!r} have {n} agent(s); allowed: {n}"
      )
    root = _check_first_prompt(exp, environment, tokenizer)
    _check_fork(exp, environment, root.threads)
    if env.workers == "processes":
      _check_pickles(exp, root)
  finally:
    if hasattr(environment, "close"):
      environment.close()
  return factory


def _check_first_prompt(exp: Experiment, environment, tokenizer):
  """The first train task's prompt, rendered as the rollout renders it, plus one full
  completion must stay under `env.max_tokens`: else every trajectory is truncated
  after its first turn and no group ever differs."""
  limit, new = exp.env.max_tokens, exp.sampling.max_new_tokens
  renderer = builders.make_renderer(exp.tokenizer, tokenizer)
  transition = EnvTransition(renderer, exp.tree.num_agents)
  with _Resolving(
      f"env.factory={exp.env.factory!r}: the initial thread of the first task "
      f"of tasks.source={exp.tasks.source!r}",
      "initial_thread() / initial_threads() that render",
  ):
    root = transition.root_state(environment)
    prompt = max(len(p) for p in transition.prompts(root))
  if prompt + new >= limit:
    raise ValueError(
        f"config env.max_tokens={limit}: the first task's prompt (system prompt "
        f"with tool schemas, rendered) takes {prompt} tokens, plus "
        f"sampling.max_new_tokens={new} reaches {prompt + new}, so every "
        "trajectory is truncated after its first turn; allowed: env.max_tokens > "
        f"{prompt + new} (raise env.max_tokens, with rl.length_buckets to hold "
        "it, or shorten the prompt)"
    )
  return root


def _check_fork(exp: Experiment, environment, threads):
  """Tree rollouts fork the environment and each agent's thread (its metadata) at every
  branch: the sample ones must fork (`envs.fork_error_message` says how to fix it)."""
  for obj in (environment, *threads):
    try:
      child = obj.fork()
    except Exception as e:  # any failure of user code: reported, never a traceback
      cause = e.__cause__ if isinstance(e, ContractError) and e.__cause__ is not None else e
      raise ValueError(
          f"config env.factory={exp.env.factory!r}: {fork_error_message(obj, cause)}"
      ) from e
    if child is not obj and hasattr(child, "close") and callable(child.close):
      child.close()


def _check_pickles(exp: Experiment, root):
  """`env.workers='processes'` ships every step's state (the environment and its threads)
  to a worker process by pickle: the first task's root state must pickle (an environment
  holding a lock, an open file, or a text generator that samples on the engine does not)."""
  try:
    pickle.dumps(root)
  except Exception as e:  # any failure of user code: reported, never a traceback
    raise ValueError(
        f"config env.factory={exp.env.factory!r}: {workers_lib.unpicklable_message('state', e)}"
    ) from e


def check_microbatches(exp: Experiment):
  """`step.num_microbatches` splits every train batch the run can form into equal
  micro-batches: each planned row bucket (`shapes.plan_shapes`, as many rows from
  every process) and the SFT batch."""
  m = exp.step.num_microbatches
  if m == 1:
    return
  import jax  # the mesh's row shards: the process count and devices decide the buckets

  from mtrl_jax.run import shapes as shapes_lib

  n = jax.process_count()
  data, fsdp, _ = exp.mesh.shape(jax.device_count())
  rows = max(1, data * fsdp // n)
  plan = shapes_lib.plan_shapes(shapes_lib.per_process(exp, n), rows, rows)
  batches = sorted({r * n for r in plan.train_rows})
  bad = [b for b in batches if b % m]
  if bad:
    divisors = [d for d in range(1, min(batches) + 1) if all(b % d == 0 for b in batches)]
    raise ValueError(
        f"config step.num_microbatches={m} does not divide the train batches of "
        f"{bad} rows (planned from rl.roots_per_step, the tree and the mesh: "
        f"{batches}); allowed: one of {divisors}"
    )
  if (exp.sft.steps or exp.sft.mix_every) and exp.sft.batch_size % m:
    raise ValueError(
        f"config step.num_microbatches={m} does not divide sft.batch_size="
        f"{exp.sft.batch_size}; allowed: a divisor of sft.batch_size and of the "
        f"train batches {batches}"
    )


def check_curriculum(exp: Experiment):
  """With a curriculum, the task source must serve every level of the train split."""
  cur, tasks = exp.curriculum, exp.tasks
  if not cur.enabled:
    return
  if cur.level_key in dict(tasks.kwargs):
    raise ValueError(
        f"config curriculum.level_key={cur.level_key!r} is also set in "
        "tasks.kwargs; allowed: the curriculum alone sets it"
    )
  for level in range(cur.num_levels):
    with _Resolving(
        f"curriculum.num_levels={cur.num_levels}: tasks.source="
        f"{tasks.source!r} with {cur.level_key}={level}",
        f"a task source taking {cur.level_key}=0 .. num_levels - 1",
    ):
      if len(builders.make_level_source(tasks, cur, level)) == 0:
        raise ValueError("the level has no tasks")


def success_threshold(exp: Experiment, factory) -> float:
  """`eval.success_threshold`, or the top of the factory's outcome range when unset.

  Outcomes are `reward.outcome_weight` x a score in `factory.outcome_range`; a
  threshold at or above the top outcome makes success impossible, one below the
  bottom makes every ended trajectory a success: both are refused.
  """
  with _Resolving(
      f"env.factory={exp.env.factory!r}: its outcome_range",
      "a (lowest, highest) pair of finite numbers",
  ):
    lo, hi = (float(x) for x in factory.outcome_range)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
      raise ValueError(f"outcome_range={factory.outcome_range!r}")
  w = exp.reward.outcome_weight
  t = exp.eval.success_threshold
  if t is None:
    return success_threshold_for((lo, hi), w)
  if not w * lo <= t < w * hi:
    raise ValueError(
        f"config eval.success_threshold={t!r}: outcomes of env.factory="
        f"{exp.env.factory!r} span [{w * lo:g}, {w * hi:g}] (outcome_range "
        f"({lo:g}, {hi:g}) x reward.outcome_weight={w:g}), so "
        f"{'none' if t >= w * hi else 'every one'} would pass; allowed: a number "
        f"in [{w * lo:g}, {w * hi:g}), or None (a full score: "
        f"{success_threshold_for((lo, hi), w):g})"
    )
  return float(t)


# A cross tree whose joint actions per node exceed this many times the step's roots:
# each step's samples come from few tasks, however large the batch.
CROSS_WIDTH_RATIO = 4


def advisories(exp: Experiment) -> list[str]:
  """One line per setting that is legal but probably not what was meant.

  Args:
    exp: the validated experiment.
  Returns:
    The lines (without the `warning: ` prefix), in field order; [] for none.
  """
  out = []
  if exp.rl.max_staleness >= 1 and exp.loss.is_correction == "none":
    out.append(
        f"config rl.max_staleness={exp.rl.max_staleness} with loss.is_correction='none':"
        " rollouts sample with parameters one update old and nothing reweights the "
        "ratio to the policy being trained; 'tis', 'mis_token' or 'mis_action' "
        "corrects for it"
    )
  rank, width = exp.model.lora.rank, exp.model.arch.d_model
  if rank and rank >= width:
    out.append(
        f"config model.lora.rank={rank} is at or above the model width d_model={width}: "
        "the adapters are not low-rank (at least as many parameters as the weights "
        "they adapt); a rank below d_model, or 0 (full fine-tuning), trains the same "
        "directions for less"
    )
  tree, roots = exp.tree, exp.rl.roots_per_step
  if tree.joint_mode == "cross" and tree.actions_per_node > CROSS_WIDTH_RATIO * roots:
    out.append(
        f"config tree.joint_mode='cross' with tree.num_generations="
        f"{tree.num_generations} and tree.num_agents={tree.num_agents}: "
        f"{tree.actions_per_node} joint actions (G^N) per node against "
        f"rl.roots_per_step={roots}, so a step's samples come from few tasks; "
        "joint_mode='align' or 'marginal', a smaller G, or more roots per step "
        "spread them"
    )
  return out
