"""A saved run: its config (`workdir/config.json`), the resume guard, and its policy
rebuilt from one of its checkpoints.

What `experiments/eval.py` and `experiments/export.py` do, as library calls:

  policy = load_policy(workdir, "best")        # or "latest", or a step number
  print(policy.using)                          # using best checkpoint: step 40 (...)
  rows = evaluate_policy(policy, num_tasks=100, samples=4)
  print(markdown_table(rows))
  export_policy(policy, out_dir)               # a Hugging Face directory

The run is rebuilt exactly as `run.rl` built it (the same validation, vocabulary
fit included, then `run.components.build`), so a checkpoint restores onto the
same pytree (`train.policies` fixes its layout); only its parameters are kept.
A run's config is saved as `workdir/config.json` (`save_config`) and read back
over today's base config (`load_config`). `check_resume` refuses to resume a
workdir that holds another run (docs/internals.md, "Resuming and storage faults").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
from typing import Any, Optional, Union

import jax
import ml_collections
from flax import nnx

from mtrl_jax import checkpoint, compile_cache, storage
from mtrl_jax.run import components, defaults, groups
from mtrl_jax.run import evaluate as eval_lib
from mtrl_jax.run import experiment as exp_lib
from mtrl_jax.run.components import Components
from mtrl_jax.run.run_state import RunState

# Files of an HF tokenizer copied next to the exported weights when the run has them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
# What a byte-tokenizer run writes instead (transformers has no byte tokenizer).
BYTE_TOKENIZER_FILE = "mtrl_byte_tokenizer.json"
EXPORT_FILE = "mtrl_export.json"  # which run and step an export holds
# The config fields a resumed run may change: how long it trains, how often it
# evaluates, dumps and saves, and where and in how many pieces it computes (the
# same values either way). Any other difference makes it another run.
RESUME_MAY_CHANGE = (
    "rl.steps",
    "eval.every",
    "eval.num_tasks",
    "rl.dump_every",
    "checkpoint.every",
    "checkpoint.keep",
    "rl.precompile",
    "rl.halt_if_idle_steps",
    "rl.max_masked_fraction",
    "rl.masked_window",
    "step.num_microbatches",
    "model.remat",
    "mesh.*",
    "distributed.*",
    "compile_cache",
)


def save_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes `config` as `workdir/config.json` (created; replaced whole, never half
  written); returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  storage.replace_text(path, config.to_json_best_effort(indent=2, sort_keys=True))
  return path


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run saved as `workdir/config.json`, over today's base config: a field
  added since the run was saved takes its default (the saved fields keep their values)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise exp_lib.ConfigError(
        f"--workdir={workdir!r} has no config.json; allowed: the "
        "workdir of an experiments/train.py run"
    )
  try:
    with open(path) as f:
      saved = json.load(f)
  except ValueError as e:
    raise exp_lib.ConfigError(
        f"{path} is not valid JSON ({' '.join(str(e).split())}); "
        "allowed: the config.json an experiments/train.py run wrote"
    ) from None
  config = defaults.base_config()
  config.update(saved)
  return config


def _flat(tree: Any, prefix: str = "") -> dict:
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def _as_json(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json_best_effort(sort_keys=True))


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses to start `config` in a workdir that holds another run; reads only.

  A workdir holds a run once it has a config.json (or checkpoints). The saved
  config (read over today's base config, as `load_config`) and `config` may
  differ only in the fields of `RESUME_MAY_CHANGE`.
  Raises:
    ConfigError (one line) listing each differing field with both values, or for
    checkpoints without a config.json.
  """
  has_ckpt = any(
      checkpoint.step_dirs(os.path.join(workdir, d))
      for d in (checkpoint.CKPT_DIR, checkpoint.BEST_DIR)
  )
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    if has_ckpt:
      raise exp_lib.ConfigError(
          f"workdir {workdir} holds checkpoints but no config.json, so its run cannot be "
          "compared with this one; allowed: the workdir of an experiments/train.py run "
          "(its config.json restored), or another --workdir"
      )
    return
  before, now = _flat(_as_json(load_config(workdir))), _flat(_as_json(config))
  missing = object()
  differ = [
      k
      for k in sorted(now)
      if before.get(k, missing) != now[k]
      and not any(fnmatch.fnmatchcase(k, pat) for pat in RESUME_MAY_CHANGE)
  ]
  if differ:
    show = lambda v: "(unset)" if v is missing else json.dumps(v)
    listed = ", ".join(f"{k} ({show(before.get(k, missing))} -> {show(now[k])})" for k in differ)
    raise exp_lib.ConfigError(
        f"workdir {workdir} holds another run: differs in {listed}; allowed to change on "
        f"resume: {', '.join(RESUME_MAY_CHANGE)}; or use another --workdir"
    )


def parse_checkpoint(value: Union[str, int]) -> Union[str, int]:
  """'best' | 'latest' | a step number (int >= 0)."""
  text = str(value).strip()
  if text in ("best", "latest"):
    return text
  if text.isdigit():
    return int(text)
  raise exp_lib.ConfigError(f"--checkpoint={value!r}; allowed: 'best', 'latest' or a step number")


@dataclasses.dataclass
class SavedPolicy:
  """A run's policy at one checkpoint: the run's parts (`run.components`) and the
  checkpoint's parameters (stacked on an agent axis when each agent has its own)."""

  workdir: str
  parts: Components
  step: int
  checkpoint: str  # 'best' | 'latest' | 'step'
  saved_params: Any = None  # None: every policy's starting weights, as built
  score: Optional[tuple[str, float]] = None  # the best checkpoint's (metric, value)

  exp = property(lambda self: self.parts.exp)
  tokenizer = property(lambda self: self.parts.tokenizer)
  renderer = property(lambda self: self.parts.renderer)

  def __post_init__(self):
    if self.saved_params is None:  # as built, in a checkpoint's layout (stacked, per group)
      self.saved_params = self.parts.policies.init_state().params

  @property
  def params(self):
    """What the engine samples with: the policy's params, or every agent's stacked."""
    return self.parts.policies.sampler_states(self.saved_params)

  def models(self) -> list:
    """One model per policy (the shared one, or one per agent) with the saved weights."""
    params = self.parts.policies.per_policy(self.saved_params)
    # Each policy's own architecture (a team's agents may differ).
    graphdefs = [nnx.graphdef(m) for m in self.parts.policies.models]
    return [nnx.merge(g, p) for g, p in zip(graphdefs, params)]

  @property
  def model(self):
    """The shared policy's model (separate policies: `models()`)."""
    if self.parts.policies.per_agent:
      raise ValueError("this run trained one policy per agent; use SavedPolicy.models()")
    return self.models()[0]

  @property
  def label(self) -> str:
    return f"{self.checkpoint} (step {self.step})"

  @property
  def using(self) -> str:
    """One line: which checkpoint and step, and the score the best one was kept for."""
    if self.checkpoint == "step":
      return f"using checkpoint step {self.step}"
    score = f" ({self.score[0]} {self.score[1]:.3g})" if self.score else ""
    return f"using {self.checkpoint} checkpoint: step {self.step}{score}"

  @property
  def warning(self) -> str:
    """One line when the best checkpoint is the untrained step 0, else ''."""
    if self.checkpoint != "best" or self.step != 0:
      return ""
    return (
        "the best checkpoint is step 0, saved before any RL update: no later held-out "
        "evaluation beat it"
    )


def load_policy(workdir: str, which: Union[str, int] = "best") -> SavedPolicy:
  """Rebuilds the run of `workdir` and restores the parameters of checkpoint `which`.

  Args:
    workdir: a training run's directory (config.json plus ckpt/ and best/).
    which: 'best' (kept by held-out success), 'latest', or a saved step.
  Raises:
    ConfigError (one line) for a missing config or checkpoint, or one that does
    not read back; the config itself is validated as at the start of training.
    'latest' skips an unreadable checkpoint for the one before (one warning line
    on stderr names it), as a resumed run does.
  Programs compile through the run's `compile_cache` setting, as training does,
  so an eval or export after the run, or a second one, loads what it compiled.
  """
  which = parse_checkpoint(which)
  config = load_config(workdir)
  exp = exp_lib.validate(config)
  try:
    compile_cache.setup(config.get("compile_cache", compile_cache.AUTO))
  except ValueError as e:
    raise exp_lib.ConfigError(str(e)) from None
  if not any(
      os.path.isdir(os.path.join(workdir, d)) for d in (checkpoint.CKPT_DIR, checkpoint.BEST_DIR)
  ):
    raise exp_lib.ConfigError(
        f"--workdir={workdir!r} has no checkpoints; allowed: the workdir "
        "of a run that saved one (ckpt/ or best/)"
    )
  ckpt = checkpoint.Checkpointer(
      workdir, keep=exp.checkpoint.keep, async_save=False, read_only=True
  )
  try:
    steps = ckpt.all_steps()
    best = ckpt.best()  # an unreadable one: a warning line names it, then None
    if which == "best" and best is None:
      raise exp_lib.ConfigError(
          f"--checkpoint=best: {workdir} has no readable best "
          f"checkpoint; allowed: 'latest' or a saved step {steps}"
      )
    if (which == "latest" and not steps) or (isinstance(which, int) and which not in steps):
      raise exp_lib.ConfigError(
          f"--checkpoint={which}: not saved under {workdir}/ckpt; "
          f"allowed: 'best', 'latest' or a saved step {steps}"
      )
    parts = components.build(exp)
    policies = parts.policies
    run_state = RunState.of(exp, policies, critic_model=parts.critic)
    score = None
    restored = None
    if which == "best":
      saved, meta = ckpt.restore_best(policies.saved_state_target())
      step = best["step"]
      evals = meta.get("eval", {})
      name = next(
          (k for k in ("eval/greedy/success", "eval/sampled/success") if k in evals),
          "held-out score",
      )
      score = (name, best["score"])
    elif which == "latest":
      step, restored, _ = ckpt.restore_latest(run_state.target())
      saved = restored["train"]
    else:
      step = which
      restored, _ = ckpt.restore(run_state.target(), step=step)
      saved = restored["train"]
    if run_state.keep_base:  # adapters over a base the SFT warm-up trained: the run's base
      if restored is None:  # best/ keeps the adapters only; the base is every ckpt's
        _, restored, _ = ckpt.restore_latest(run_state.target())
      policies.train_step.set_base(restored["base"])
    state = policies.state_from_saved(saved)
  except checkpoint.CheckpointError as e:
    others = "'latest'" if which == "best" else "'best', 'latest'"
    raise exp_lib.ConfigError(
        f"--checkpoint={which}: {e}; allowed: {others} or a saved step {steps}"
    ) from None
  finally:
    ckpt.close()
  kind = "step" if isinstance(which, int) else which
  return SavedPolicy(os.path.abspath(workdir), parts, int(step), kind, state.params, score)


def evaluate_policy(
    policy: SavedPolicy, *, num_tasks: int = 0, samples: int = 1, greedy: bool = True, seed: int = 0
) -> list[dict]:
  """Held-out rollouts of the policy, as `run.rl` evaluates during training.

  Args:
    policy: from `load_policy`.
    num_tasks: the first K tasks of the eval split (0: the run's eval.num_tasks).
    samples: k sampled (temperature 1) attempts per task; k > 1 adds pass@k,
      the fraction of tasks that any of their k attempts solved.
    greedy: also a greedy single-path evaluation.
    seed: the sampling key.
  Returns:
    One row per mode: {'checkpoint', 'mode', 'tasks', 'attempts', 'success',
    'outcome', 'return', 'turns', 'masked'[, 'pass@k']}.
  """
  exp = policy.exp
  if num_tasks < 0 or samples < 1:
    raise exp_lib.ConfigError(
        f"--num_tasks={num_tasks}, --samples={samples}; allowed: "
        "num_tasks >= 0 (0: the run's eval.num_tasks), samples >= 1"
    )
  tasks = eval_lib.indexed(policy.parts.eval_tasks, num_tasks or exp.eval.num_tasks)
  modes = ([("greedy", True, 1)] if greedy else []) + (
      [("sampled", False, samples)] if samples > 1 or not greedy else []
  )
  rows = []
  for mode, is_greedy, attempts in modes:
    key = jax.random.fold_in(jax.random.PRNGKey(seed), len(rows))
    res = policy.parts.evaluator(policy.params, tasks, greedy=is_greedy, key=key, samples=attempts)
    rows.append(
        {"checkpoint": policy.label, "mode": mode, "tasks": len(tasks), "attempts": attempts, **res}
    )
  return rows


def markdown_table(rows: list[dict]) -> str:
  """The rows of `evaluate_policy` as a markdown table (pass@k only where measured)."""
  cols = ["checkpoint", "mode", "tasks", "attempts", "success", "outcome", "return", "turns"]
  cols += sorted({c for r in rows for c in r if c.startswith("pass@")})

  def cell(v):
    if v is None:
      return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)

  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def export_policy(policy: SavedPolicy, out_dir: str) -> dict:
  """Writes the policy as a Hugging Face directory `transformers` can load; a run
  with one policy per agent writes one directory per agent, `out_dir/agent_<a>`.

  config.json + model.safetensors (sharded above 4 GiB) from
  `models.loading.save_pretrained`; for an HF-tokenizer run its tokenizer
  files (`TOKENIZER_FILES` found in model.path). A byte-tokenizer run has no
  HF tokenizer: `mtrl_byte_tokenizer.json` describes it instead (rebuild it
  with `mtrl_jax.text.ByteTokenizer(specials=...)`).

  Returns:
    {'out': dir, 'weights': [files], 'tokenizer': [files], 'note': str}; separate
    policies: {'out': dir, 'agents': [that dict per agent]}.
  """
  if policy.parts.policies.per_agent:
    renderers = policy.parts.transition.renderers  # each agent's tokenizer
    agents = [
        _export_one(
            policy,
            model,
            os.path.join(out_dir, f"agent_{a}"),
            renderers[a].tokenizer,
            groups.agent_tokenizer_dir(policy.exp, a),
        )
        for a, model in enumerate(policy.models())
    ]
    return {"out": os.path.abspath(out_dir), "agents": agents}
  return _export_one(policy, policy.model, out_dir, policy.tokenizer, policy.exp.model.path)


def clear_export(out_dir: str) -> list[str]:
  """Removes what an earlier export wrote into `out_dir` (config.json, the weights,
  tokenizer files, mtrl_*.json, agent_<a>/ of separate policies), so no stale shard
  stays beside the next export; other files stay. Returns the removed names."""
  from mtrl_jax.models import loading

  names = {
      "config.json",
      loading.SINGLE_FILE,
      loading.INDEX_FILE,
      BYTE_TOKENIZER_FILE,
      EXPORT_FILE,
      *TOKENIZER_FILES,
  }
  removed = []
  for name in sorted(os.listdir(out_dir)):
    path = os.path.join(out_dir, name)
    if os.path.isdir(path) and name.startswith("agent_") and name[6:].isdigit():
      shutil.rmtree(path)
    elif os.path.isfile(path) and (
        name in names or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name)
    ):
      os.remove(path)
    else:
      continue
    removed.append(name)
  return removed


def _export_one(policy: SavedPolicy, model, out_dir: str, tok, tokenizer_dir: str) -> dict:
  """One policy's directory: `model` with the tokenizer `tok` (an HF tokenizer's files
  copied from `tokenizer_dir`)."""
  from mtrl_jax.models import loading

  weights = loading.save_pretrained(model, out_dir)  # every process gathers
  exp = policy.exp
  if jax.process_index() != 0:
    return {"out": os.path.abspath(out_dir), "weights": weights, "tokenizer": [], "note": ""}
  # The special ids generation needs (config.json from ModelConfig has none).
  with open(os.path.join(out_dir, "config.json")) as f:
    hf = json.load(f)
  hf.update(
      {
          k: v
          for k, v in (
              ("pad_token_id", tok.pad_id),
              ("eos_token_id", tok.eos_id),
              ("bos_token_id", getattr(tok, "bos_id", None)),
          )
          if v is not None
      }
  )
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if exp.tokenizer.kind == "hf":
    path = tokenizer_dir
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
    for f in copied:
      shutil.copyfile(os.path.join(path, f), os.path.join(out_dir, f))
    note = f"tokenizer files copied from {path}"
  else:
    desc = {
        "kind": "byte",
        "num_bytes": 256,
        "vocab_size": tok.vocab_size,
        "special_tokens": list(tok.special_tokens),
        "special_ids": {s: 256 + i for i, s in enumerate(tok.special_tokens)},
        "pad_id": tok.pad_id,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "chat_format": exp.tokenizer.chat_format,
        "how_to_load": "mtrl_jax.text.ByteTokenizer(specials=special_tokens): ids 0-255 "
        "are UTF-8 bytes, special tokens follow in this order",
    }
    with open(os.path.join(out_dir, BYTE_TOKENIZER_FILE), "w") as f:
      json.dump(desc, f, indent=2)
    copied = [BYTE_TOKENIZER_FILE]
    note = (
        "byte-level tokenizer: transformers has no tokenizer for it, so no tokenizer.json "
        f"was written; {BYTE_TOKENIZER_FILE} describes it"
    )
  with open(os.path.join(out_dir, EXPORT_FILE), "w") as f:
    json.dump(
        {"workdir": policy.workdir, "checkpoint": policy.checkpoint, "step": policy.step},
        f,
        indent=2,
    )
  return {"out": os.path.abspath(out_dir), "weights": weights, "tokenizer": copied, "note": note}
