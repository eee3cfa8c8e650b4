"""Prints whole episodes of a run's rollout dumps, readable on a terminal.

  python -m experiments.show --workdir=runs/calc --episodes=5
  python -m experiments.show --workdir=runs/calc --step=40 --episodes=3 --seed=1

A dump (`workdir/rollouts/step_NNNNNN.jsonl`, one JSON object per tree node,
written every `rl.dump_every` steps; `mtrl_jax/rollout/dump.py`) holds every
node of a step's trees. An episode is one path through a tree: from a root,
one joint action per turn, down to the action that has no child (the episode
ended, was cut at the last turn, masked, or its node was made a leaf). The
tool picks `--episodes` of the step's paths at random (`--seed`) and prints
each turn: the context the environment added (the whole prompt at the root),
each agent's completion (under `tree.branch_on='user_turn'` its sampled
segments and the tool turns between them), the joint action's reward with
its parts, return and each agent's advantage, grades and faults, and how the
episode ended.
"""

from __future__ import annotations

import random

from absl import flags

from experiments import cli
from mtrl_jax.rollout.dump import dump_files, no_dumps_message, read_dump

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (with rollouts/)")
_STEP = flags.DEFINE_integer("step", None, "the dumped step to read (default: the latest)")
_EPISODES = flags.DEFINE_integer("episodes", 5, "episodes to print (at most every path)")
_SEED = flags.DEFINE_integer("seed", 0, "which episodes are picked")
flags.mark_flag_as_required("workdir")

INDENT = "      "


def episodes(nodes: list[dict]) -> list[list[tuple[dict, int]]]:
  """Every path of the dump's trees: [(node, joint action), ...] from a root to an
  action without a child, roots and joint actions in order."""
  by_id = {n["node_id"]: n for n in nodes}
  out = []

  def walk(node, path):
    for b, child in enumerate(node["children"]):
      step = path + [(node, b)]
      if child >= 0 and child in by_id:
        walk(by_id[child], step)
      else:
        out.append(step)

  for node in nodes:
    if node["parent_id"] < 0:
      walk(node, [])
  return out


def _printable(text: str) -> str:
  return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _block(label: str, text: str) -> list[str]:
  lines = _printable(text).split("\n")
  return [f"    {label}:"] + [INDENT + line for line in lines]


def _texts(node: dict, key: str):
  """The node's decoded `prompts` / `completions`, or its ids where the dump has no text."""
  if key in node:
    return node[key]
  ids = node.get(key[:-1] + "_ids")
  if ids is None:
    return None
  if key == "prompts":
    return [f"(ids) {p}" for p in ids]
  return [[f"(ids) {c}" for c in agent] for agent in ids]


def _num(x) -> str:
  return "nan" if x is None else f"{x:.3f}"


def _context(node: dict, agent: int, before: str) -> tuple[str, str]:
  """(label, text) of what agent `agent` reads at `node` that it has not seen: the whole
  prompt at a root, else what follows the previous turn's prompt and completion."""
  prompt = _texts(node, "prompts")[agent]
  if "prompts" not in node:  # a dump of token ids
    return f"prompt ids (agent {agent})", prompt
  if node["parent_id"] < 0 or before is None:
    return f"prompt (agent {agent})", prompt
  if prompt.startswith(before):
    return f"context (agent {agent})", prompt[len(before) :]
  return f"context (agent {agent}, history rewritten: the whole prompt)", prompt


def _completion_lines(node: dict, agent: int, g: int) -> list[str]:
  reason = node.get("finish_reasons", [[]] * (agent + 1))[agent]
  finish = f", finish: {reason[g]}" if g < len(reason) else ""
  label = f"completion (agent {agent}, sample {g}{finish})"
  segments = node.get("segments")
  if segments and len(segments[agent][g]) > 1:
    out = [f"    {label}:"]
    for seg in segments[agent][g]:
      text = seg.get("text", f"(ids) {seg.get('ids')}")
      kind = "policy" if seg["sampled"] else "tool / context"
      out += [f"      [{kind}]"] + [INDENT + "  " + line for line in _printable(text).split("\n")]
    return out
  return _block(label, _texts(node, "completions")[agent][g])


def _outcome_lines(node: dict, b: int) -> list[str]:
  action = (node.get("actions") or [None] * (b + 1))[b] or {}
  parts = {}
  for step in action.get("steps", []):
    for k, v in step.get("parts", {}).items():
      parts[k] = parts.get(k, 0.0) + v
  reward = f"    reward {_num(node['rewards'][b])}"
  if parts:
    reward += " = " + " + ".join(f"{k} {_num(v)}" for k, v in parts.items())
  out = [reward + f"; return {_num(node['returns'][b])}"]
  joint = node["joint_actions"][b]
  adv = ", ".join(f"agent {a}: {_num(node['advantages'][a][g])}" for a, g in enumerate(joint))
  out.append(f"    advantage {adv}")
  if "agent_rewards" in node:
    mixed = ", ".join(f"agent {a}: {_num(r)}" for a, r in enumerate(node["agent_rewards"][b]))
    out.append(f"    agent rewards {mixed}")
  for step in action.get("steps", []):
    for key in ("grades", "cut_grades"):
      for name, grade in (step.get(key) or {}).items():
        why = f" ({grade['reason']})" if grade.get("reason") else ""
        tag = "cut grade" if key == "cut_grades" else "grade"
        out.append(f"    {tag} \"{name}\": {_num(grade.get('score'))}{why}")
  for fault in action.get("faults", []):
    out.append(
        f"    fault {fault.get('kind')} ({fault.get('source')}): "
        f"{_printable(str(fault.get('message')))}"
    )
  return out


def _ending(node: dict, b: int) -> str:
  action = (node.get("actions") or [None] * (b + 1))[b] or {}
  steps = action.get("steps") or [{}]
  if not node["valid"][b]:
    return "masked (not trained on)"
  if steps[-1].get("cut"):
    return "cut at the tree's last turn (graded by the environment's on_cut)"
  if action.get("limit_reached"):
    return "truncated: tree.max_substeps reached"
  if action.get("ended"):
    return "ended by the environment"
  if node["terminated"]:
    return "its node was made a leaf (early termination)"
  return "not ended: the tree went no further (its last turn)"


def format_episode(path: list[tuple[dict, int]], step: int, index: int, count: int) -> str:
  """One episode (a path of `episodes`) as text."""
  root, _ = path[0]
  total = sum(node["rewards"][b] or 0.0 for node, b in path)
  last, b_last = path[-1]
  head = (
      f"=== episode {index} of {count} | step {step} | root {root['root']} | "
      f"{len(path)} turn(s) | rewards summed {_num(total)} ==="
  )
  lines = [head]
  seen = None  # per agent: the text the agent had read and written before this turn
  for node, b in path:
    joint = node["joint_actions"][b]
    lines.append(f"  turn {node['turn']} (node {node['node_id']}, joint action {b})")
    prompts = _texts(node, "prompts")
    comps = _texts(node, "completions")
    for agent, g in enumerate(joint):
      if prompts is not None:
        label, text = _context(node, agent, None if seen is None else seen[agent])
        lines += _block(label, text)
      if comps is not None:
        lines += _completion_lines(node, agent, g)
    lines += _outcome_lines(node, b)
    if prompts is not None and comps is not None:
      seen = [prompts[a] + comps[a][g] for a, g in enumerate(joint)]
  lines.append(f"  end: {_ending(last, b_last)}")
  return "\n".join(lines)


def show(workdir: str, episodes_wanted: int, step=None, seed: int = 0) -> str:
  """The text `experiments.show` prints (see the module docstring).

  Raises:
    ValueError (one line) when `workdir` has no dump, or none of `step`.
  """
  files = dump_files(workdir)
  if not files:
    raise ValueError(no_dumps_message(workdir))
  if step is None:
    step = max(files)
  elif step not in files:
    raise ValueError(f"--step={step}: {workdir} has no dump of it; allowed: {list(files)}")
  paths = episodes(read_dump(files[step]))
  if not paths:
    return f"step {step}: the dump holds no episode"
  picked = sorted(random.Random(seed).sample(range(len(paths)), min(episodes_wanted, len(paths))))
  head = (
      f"{workdir}: step {step} ({len(paths)} episodes in its dump; dumped steps: "
      f"{_steps(files)})"
  )
  body = [format_episode(paths[i], step, k + 1, len(picked)) for k, i in enumerate(picked)]
  return "\n\n".join([head] + body)


def _steps(files: dict) -> str:
  steps = list(files)
  return (
      ", ".join(map(str, steps))
      if len(steps) <= 8
      else (f"{steps[0]}, {steps[1]}, ..., {steps[-1]}")
  )


def main(argv):
  del argv
  if _EPISODES.value < 1:
    cli.refuse(f"--episodes={_EPISODES.value}; allowed: an integer >= 1")
  try:
    text = show(_WORKDIR.value, _EPISODES.value, _STEP.value, _SEED.value)
  except ValueError as e:
    cli.refuse(e)
  print(text)


if __name__ == "__main__":
  cli.run(main)
