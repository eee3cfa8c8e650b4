"""The rollout dump: `workdir/rollouts/step_NNNNNN.jsonl`, one JSON object per tree node.

Each line holds the node's place in the tree (`node_id`, `root`, `parent_id`,
`parent_action`, `turn`, `children`), its joint actions with `rewards`,
`returns` and `valid` flags, per agent per sample `advantages`,
`agent_returns` and `weights`, `terminated`, with several agents per agent
per joint action `agent_rewards` (the mixed reward each is trained on) and
`local_rewards` (`rollout.credit`), each joint action's record
(`actions`: reward, validity, faults and every environment step, from
`rollout.records.ActionRecord.to_json`), and the texts (prompt per agent, completion per agent per
sample) when a decoder is given, token ids otherwise.

Under `branch_on='user_turn'` a node also records `substeps` (continuation
segments per joint action) and, per agent per sample, `segments`: the
completion cut into runs `{"sampled": bool, "text" | "ids": ...}`, sampled
segments alternating with the context between them (the tool turns and
headers); each joint action's record lists every step.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from typing import Callable, Optional

import numpy as np

from mtrl_jax import storage
from mtrl_jax.rollout.tree import Tree


def dump_path(workdir: str, step: int) -> str:
  """`workdir/rollouts/step_NNNNNN.jsonl`."""
  return os.path.join(workdir, "rollouts", f"step_{int(step):06d}.jsonl")


def _num(x) -> Optional[float]:
  x = float(x)
  return x if math.isfinite(x) else None  # strict JSON has no NaN / Infinity


def _nums(a) -> list:
  return [_nums(v) if np.ndim(v) else _num(v) for v in a]


def _jsonable(obj):
  if isinstance(obj, dict):
    return {str(k): _jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_jsonable(v) for v in obj]
  if isinstance(obj, np.ndarray):
    return _jsonable(obj.tolist())
  if isinstance(obj, (bool, np.bool_)):
    return bool(obj)
  if isinstance(obj, (int, np.integer)):
    return int(obj)
  if isinstance(obj, (float, np.floating)):
    return _num(obj)
  if obj is None or isinstance(obj, str):
    return obj
  return str(obj)


def node_records(tree: Tree, decode=None) -> list[dict]:
  """The dump's JSON-able record of every node, in node-id order; `decode` as for
  `write_rollout_dump`."""
  if not tree.finalized:
    raise ValueError("node_records needs a finalized tree (call Tree.finalize())")
  decoders = decode if isinstance(decode, (list, tuple)) else [decode] * tree.cfg.num_agents
  records = []
  for node in tree.nodes:
    rec = {
        "node_id": node.node_id,
        "root": node.root,
        "parent_id": node.parent_id,
        "parent_action": node.parent_action,
        "turn": node.turn,
        "terminated": bool(node.terminated),
        "joint_actions": tree.node_joint(node).tolist(),
        "children": node.children_B.tolist(),
        "rewards": _nums(node.rewards_B),
        "returns": _nums(node.returns_B),
        "valid": node.valid_B.tolist(),
        "agent_returns": _nums(node.agent_returns_NxG),
        "advantages": _nums(node.advantages_NxG),
        "weights": _nums(node.weight_NxG),
        "actions": [_jsonable(a.to_json()) for a in node.actions],
    }
    if tree.cfg.num_agents > 1:
      rec["agent_rewards"] = _nums(node.agent_rewards_BxN)
      rec["local_rewards"] = _nums(node.local_BxN)
    comps = node.completions or []
    rec["finish_reasons"] = [[c.finish_reason for c in agent] for agent in comps]
    if decode is not None:
      rec["prompts"] = [dec(list(p)) for dec, p in zip(decoders, node.prompts)]
      rec["completions"] = [
          [dec(c.ids.tolist()) for c in agent] for dec, agent in zip(decoders, comps)
      ]
    else:
      rec["prompt_ids"] = [list(p) for p in node.prompts]
      rec["completion_ids"] = [[c.ids.tolist() for c in agent] for agent in comps]
    if tree.cfg.substeps:
      rec["substeps"] = node.substeps_B.tolist()
      rec["segments"] = [
          [_segments(c, decode and dec) for c in agent] for dec, agent in zip(decoders, comps)
      ]
    records.append(rec)
  return records


def _segments(comp, decode: Optional[Callable]) -> list[dict]:
  out = []
  for start, stop, sampled in comp.spans():
    ids = [int(t) for t in comp.ids[start:stop]]
    body = {"text": decode(ids)} if decode is not None else {"ids": ids}
    out.append({"sampled": sampled, **body})
  return out


def write_rollout_dump(tree: Tree, path: str, decode=None) -> Optional[str]:
  """Writes one JSON object per node to `path` (atomically) and returns the path.

  A dump is a diagnostic: when the file cannot be written (a full disk, a read-only
  directory) one line says so on stderr, the partial file is removed, the run goes on
  and None is returned.

  Args:
    tree: a finalized tree.
    path: output file, usually `dump_path(workdir, step)`.
    decode: token ids -> text (the tokenizer's `decode`), or one such function per
      agent (agents with tokenizers of their own); None writes ids.
  """
  records = node_records(tree, decode)
  text = "".join(json.dumps(rec, allow_nan=False, ensure_ascii=False) + "\n" for rec in records)
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    storage.replace_text(path, text)
  except OSError as e:
    print(
        f"warning: rollout dump {path} was not written: {e.strerror or e} "
        f"(errno {e.errno}); the run goes on",
        file=sys.stderr,
        flush=True,
    )
    return None
  return path


def dump_files(workdir: str) -> dict[int, str]:
  """step -> path of each rollout dump under `workdir/rollouts`."""
  out = {}
  for path in glob.glob(os.path.join(workdir, "rollouts", "step_*.jsonl")):
    m = re.search(r"step_(\d+)\.jsonl$", path)
    if m:
      out[int(m.group(1))] = path
  return dict(sorted(out.items()))


def no_dumps_message(workdir: str) -> str:
  """Why `workdir` has nothing to show, in one line."""
  if not os.path.isdir(workdir):
    return f"workdir {workdir} is not a directory; allowed: a run directory"
  every = None
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      every = json.load(f)["rl"]["dump_every"]
  except (OSError, ValueError, KeyError, TypeError):
    pass
  run = "" if every is None else f" (this run: rl.dump_every={every})"
  return (
      f"{workdir} has no rollout dumps (rollouts/step_*.jsonl): a run writes one every "
      f"rl.dump_every steps, none with rl.dump_every=0{run}"
  )


def read_dump(path: str) -> list[dict]:
  """The node records of one dump, in `node_id` order."""
  with open(path) as f:
    nodes = [json.loads(line) for line in f if line.strip()]
  return sorted(nodes, key=lambda n: n["node_id"])
