"""Exports a trained policy as a Hugging Face directory that `transformers` loads.

  python experiments/export.py --workdir=runs/calc --out=runs/calc/hf            # best checkpoint
  python experiments/export.py --workdir=runs/calc --out=/tmp/hf --checkpoint=latest
  python experiments/export.py --workdir=runs/lora --out=/tmp/adapters --format=peft

  # then, with torch and transformers installed:
  transformers.AutoModelForCausalLM.from_pretrained("runs/calc/hf")

The run is rebuilt from --workdir/config.json and --checkpoint ('best', 'latest'
or a saved step) restored; stderr names it ("using best checkpoint: step 40
(eval/greedy/success 0.62)") and warns when the best is the untrained step 0.
An unreadable latest checkpoint is skipped for the one before, with a warning
line naming it. A non-empty --out is refused unless --force, which first
removes an earlier export's files there (`saved.clear_export`). An --out that
is a run directory, is inside a run's own folders (ckpt/, best/, ...) or holds
a run directory is refused even with --force (a run's config.json would go). --out gets
config.json and model.safetensors (split into shards above 4 GiB), the
tokenizer files of an HF-tokenizer run (tokenizer.json, tokenizer_config.json,
... as found in model.path), and mtrl_export.json (which run and step). A byte-tokenizer run (the tiny
from-scratch models) has no HF tokenizer: mtrl_byte_tokenizer.json describes
it instead, and the command says so. Logits equal ours (tests/train/
test_eval_export.py checks them against transformers within 1e-4).
"""

import json
import os
import sys
from typing import Optional

from absl import app, flags, logging

from experiments import cli
from mtrl_jax.run import experiment, saved
from mtrl_jax.train import export_lora

_WORKDIR = flags.DEFINE_string("workdir", None, "the training run's directory")
_OUT = flags.DEFINE_string("out", None, "output directory (created)")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "best", "'best' | 'latest' | a step number")
_FORMAT = flags.DEFINE_enum(
    "format",
    "hf",
    ["hf", "peft"],
    "hf: a merged Hugging Face model directory (one per agent); peft: "
    "a LoRA run's adapters as PEFT directories, loaded onto the base "
    "with peft.PeftModel.from_pretrained",
)
_FORCE = flags.DEFINE_bool(
    "force",
    False,
    "export into a non-empty --out, replacing the files of an earlier export there",
)
flags.mark_flags_as_required(["workdir", "out"])

# A run's own folders: an export inside one would mix with what the run reads back.
RUN_FOLDERS = ("ckpt", "best", "tb", "rollouts", "ckpt.unreadable", "best.unreadable")
CONTAINS_DEPTH = 2  # how deep under --out a run directory is looked for


def is_run_dir(path: str) -> bool:
  """A training run's directory: config.json with metrics.jsonl or ckpt/."""
  return os.path.isfile(os.path.join(path, "config.json")) and (
      os.path.isfile(os.path.join(path, "metrics.jsonl"))
      or os.path.isdir(os.path.join(path, "ckpt"))
  )


def run_dir_conflict(out: str) -> Optional[str]:
  """Why exporting to `out` (absolute) would write over or beside a run's files: it is a
  run directory, is inside one of a run's own folders (ckpt/, best/, ...), or holds a
  run directory (up to `CONTAINS_DEPTH` levels down); None when it does none of these.
  A plain subfolder of a run (runs/x/hf) is fine."""
  if is_run_dir(out):
    return "is a run directory (it holds config.json, and metrics.jsonl or ckpt/)"
  child, parent = out, os.path.dirname(out)
  while parent != child:
    if is_run_dir(parent):
      top = os.path.relpath(out, parent).split(os.sep)[0]
      if top in RUN_FOLDERS:
        return f"is inside {top}/ of the run directory {parent}"
      break
    child, parent = parent, os.path.dirname(parent)
  level = [out] if os.path.isdir(out) else []
  for _ in range(CONTAINS_DEPTH):
    level = [
        os.path.join(d, n)
        for d in level
        for n in sorted(os.listdir(d))
        if os.path.isdir(os.path.join(d, n)) and not os.path.islink(os.path.join(d, n))
    ]
    for d in level:
      if is_run_dir(d):
        return f"contains the run directory {d}"
  return None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; allowed: flags only")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO
  out = os.path.abspath(_OUT.value)
  try:
    if os.path.exists(out) and not os.path.isdir(out):
      raise experiment.ConfigError(f"--out={_OUT.value!r} is a file; allowed: a directory")
    if os.path.abspath(_WORKDIR.value) == out:
      raise experiment.ConfigError(
          f"--out={_OUT.value!r} is the workdir; allowed: another "
          "directory (a subdirectory is fine)"
      )
    conflict = run_dir_conflict(out)
    if conflict:  # --force too: clearing it would delete a run's config.json
      raise experiment.ConfigError(
          f"--out={_OUT.value!r} {conflict}; allowed: a directory "
          "outside any run's files, even with --force (a new "
          "subfolder of the run, e.g. <workdir>/hf, is fine)"
      )
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not _FORCE.value:
      raise experiment.ConfigError(
          f"--out={_OUT.value!r} is not empty (holds {', '.join(held[:4])}"
          f"{', ...' if len(held) > 4 else ''}); allowed: a new or empty directory, or "
          "--force to replace an earlier export there"
      )
    if _FORMAT.value == "peft" and not saved.load_config(_WORKDIR.value).model.lora.rank:
      raise experiment.ConfigError(
          f"--format=peft: the run of {_WORKDIR.value} trained no adapters (model.lora.rank=0); "
          "allowed: --format=hf, or a run with model.lora.rank > 0"
      )
    policy = saved.load_policy(_WORKDIR.value, _CHECKPOINT.value)
  except experiment.ConfigError as e:
    raise app.UsageError(str(e)) from None
  print(policy.using, file=sys.stderr, flush=True)
  if policy.warning:
    print(f"warning: {policy.warning}", file=sys.stderr, flush=True)
  if held:
    saved.clear_export(out)
  if _FORMAT.value == "peft":
    dirs = export_lora.save_adapters(
        policy.parts.policies, policy.saved_params, out, base_path=policy.exp.model.path
    )
    for d in dirs:
      print(
          f"exported the adapters of {policy.label} of {policy.workdir} to {d}: "
          f"{export_lora.ADAPTER_CONFIG}, {export_lora.ADAPTER_WEIGHTS}"
      )
    print(json.dumps({"out": out, "step": policy.step, "adapters": dirs}))
    return
  info = saved.export_policy(policy, out)
  for one in info.get("agents", [info]):
    print(
        f"exported {policy.label} of {policy.workdir} to {one['out']}: "
        f"{', '.join(['config.json'] + one['weights'] + one['tokenizer'])}"
    )
  print(info.get("agents", [info])[0]["note"])
  print(json.dumps({"out": info["out"], "step": policy.step}))


if __name__ == "__main__":
  cli.run(main)
