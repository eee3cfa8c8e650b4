"""Statistics of a finalized tree: success, returns, reward parts, faults, the engine's work.

Every function reads the typed `ActionRecord`s of the nodes
(`rollout.records`). A trajectory succeeds when the action that ended it has
an outcome above the success threshold.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from mtrl_jax.envs.fault_report import show_fault_once
from mtrl_jax.envs.faults import FaultKind
from mtrl_jax.rollout.credit import credit_metrics
from mtrl_jax.rollout.records import REWARD_PARTS


def _valid_actions(node):
  for b, action in enumerate(node.actions or []):
    if action is not None and node.valid_B[b]:
      yield b, action


def fault_counts(tree) -> dict[str, float]:
  """`faults/<kind>`: faults over every step of every action (masked ones included)."""
  counts = collections.Counter(
      f"faults/{f.kind.value}"
      for node in tree.nodes
      for action in node.actions or []
      if action is not None
      for f in action.faults
  )
  return {k: float(v) for k, v in sorted(counts.items())}


def add_fault_totals(totals, tree) -> dict[str, int]:
  """The run's fault counts per kind (every kind, zeros included, and 'total') with
  `tree`'s faults added: what `summary.json` reports under 'faults'.

  `totals` is the previous result (None or {} at the start). The tree is the
  step's gathered tree (every process's roots): a (kind, source) first seen on
  another process is shown here, once (`fault_report.show_fault_once`).
  """
  out = {k.value: int((totals or {}).get(k.value, 0)) for k in FaultKind}
  for node in tree.nodes:
    for action in node.actions or []:
      for f in action.faults if action is not None else ():
        out[f.kind.value] += 1
        show_fault_once(f)
  out["total"] = sum(out[k.value] for k in FaultKind)
  return out


def reward_metrics(tree) -> dict[str, float]:
  """Mean reward components per valid joint action: `reward/outcome`, `reward/step_penalty`,
  `reward/tool_penalty`, `reward/shaping` (weighted as composed; an action's sub-steps
  summed, so the four add up to the mean action reward). Shows whether the outcome
  dominates the penalties and shaping; {} when no action composed a reward."""
  parts = [action.parts() for node in tree.nodes for _, action in _valid_actions(node)]
  parts = [p for p in parts if p]
  if not parts:
    return {}
  return {f"reward/{k}": float(np.mean([p[k] for p in parts])) for k in REWARD_PARTS}


def path_success(tree, success_threshold: float) -> float:
  """The chance that one trajectory sampled from a root succeeds within the tree's turns,
  averaged over roots: at every node each valid joint action is an equally likely sample,
  an ended action counts its outcome, a continuing one its child's chance, and one that
  neither ended nor has a child (cut at turn T, early termination) counts as no success.
  Unlike `rollout/success` (the share of ended actions that succeed, where a tree lists
  an early success once and a late one G times per level), it is comparable with the
  held-out success of single-path evaluation. NaN when no root has a valid action.
  A marginal node's unaligned combinations that went on are left out: the tree never
  followed them, so they say nothing about where a path goes."""
  chance = {}
  for node in reversed(tree.nodes):  # children always have larger ids
    vals = []
    for b, action in _valid_actions(node):
      child = int(node.children_B[b])
      if not action.ended and tree.child_slot(node, b) < 0:
        continue
      if action.ended:
        vals.append(float(action.outcome > success_threshold))
      elif child < 0:
        vals.append(0.0)
      elif chance[child] is not None:
        vals.append(chance[child])
    chance[node.node_id] = float(np.mean(vals)) if vals else None
  roots = [
      chance[n.node_id] for n in tree.nodes if n.parent_id < 0 and chance[n.node_id] is not None
  ]
  return float(np.mean(roots)) if roots else float("nan")


def is_cut(tree, node, action: int) -> bool:
  """The tree cut the episode at this valid joint action: the environment would have
  gone on past the last turn (graded as ended, `ActionRecord.cut`, or left open by a
  transition without `cut`)."""
  record = node.actions[action]
  if record is None or not node.valid_B[action]:
    return False
  return record.cut or (node.turn == tree.cfg.num_turns - 1 and not record.ended)


def cut_metrics(tree) -> dict[str, float]:
  """`tree/cut_episodes`: valid joint actions whose episode the environment would have
  continued past the tree's last turn; `tree/cut_fraction`: their share of the episodes
  (valid joint actions without a child: every way a branch ends)."""
  cut = episodes = 0
  for node in tree.nodes:
    for b, _ in _valid_actions(node):
      if node.children_B[b] < 0:
        episodes += 1
        cut += is_cut(tree, node, b)
  return {"tree/cut_episodes": float(cut), "tree/cut_fraction": cut / episodes if episodes else 0.0}


def _tool_calls(step) -> Optional[list]:
  """Per agent the tool calls of one step (`EnvTransition` records them as `tool_calls`
  when the environment offers tools), or None when it offers none."""
  calls = step.details.get("tool_calls")
  if calls is None:
    return None
  return list(calls) if isinstance(calls, (list, tuple)) else [int(calls)]


def _step_calls(action) -> int:
  """Tool calls of every step of one action (0 where the environment offers none)."""
  return sum(sum(_tool_calls(s) or ()) for s in action.steps)


def episodes(tree) -> list[tuple[int, int]]:
  """(policy turns, tool calls) of each episode of the tree: per valid joint action that
  ends a branch (no child), what its path from the root holds, sub-steps included (one
  policy turn each). A marginal node's unaligned combinations that went on are left out
  (the tree never followed them; see `path_success`)."""
  before = {}  # node id -> (turns, calls) of the path down to it
  out = []
  for node in tree.nodes:  # parents always have smaller ids
    turns, calls = before.get(node.node_id, (0, 0))
    for b, action in _valid_actions(node):
      path = (turns + len(action.steps), calls + _step_calls(action))
      child = int(node.children_B[b])
      if child >= 0:
        before[child] = path
      elif action.ended or tree.child_slot(node, b) >= 0:
        out.append(path)
  return out


def tool_metrics(tree, paths: list[tuple[int, int]]) -> dict[str, float]:
  """`tools/*` (`paths`: the tree's `episodes`): how the policy uses the tools, over the steps of environments that offer
  some (a `ToolSet` with tools; their records carry `tool_calls`). {} when no step of
  the tree offered tools, so an environment without tools logs none of these keys.

  tools/turns_with_call         share of the policy's turns (per agent per step, sub-steps
                                and masked actions included) answered with >= 1 tool turn
  tools/calls                   tool calls: one tool turn each (a malformed message's
                                error turn counts as one call)
  tools/valid_calls             calls without a fault from the tool set (a `tool:<name>`
                                source: parse failure, rejected call, failed or timed-out tool)
  tools/parse_failures_per_call malformed tool-call messages (model_format faults of the
                                tool set) / calls; 0 without calls
  tools/calls_per_episode       tool calls along an episode's path, mean over `episodes`
  """
  turns = with_call = calls = failed = parse = 0
  for node in tree.nodes:
    for action in node.actions or []:
      for step in action.steps if action is not None else ():
        per_agent = _tool_calls(step)
        if per_agent is None:
          continue
        turns += len(per_agent)
        with_call += sum(c > 0 for c in per_agent)
        calls += sum(per_agent)
        tool_faults = [f for f in step.faults if f.source.startswith("tool:")]
        failed += len(tool_faults)
        parse += sum(f.kind == FaultKind.MODEL_FORMAT for f in tool_faults)
  if not turns:
    return {}
  return {
      "tools/turns_with_call": with_call / turns,
      "tools/calls": float(calls),
      "tools/valid_calls": float(max(calls - failed, 0)),
      "tools/parse_failures_per_call": parse / calls if calls else 0.0,
      "tools/calls_per_episode": float(np.mean([c for _, c in paths])) if paths else 0.0,
  }


def turn_metrics(paths: list[tuple[int, int]]) -> dict[str, float]:
  """`rollout/past_first_turn`: share of the episodes (`paths`: the tree's `episodes`)
  whose path holds more than one policy turn (a later tree turn, or a tool sub-step); {}
  without episodes."""
  if not paths:
    return {}
  return {"rollout/past_first_turn": sum(t > 1 for t, _ in paths) / len(paths)}


def rollout_metrics(tree, success_threshold: float) -> dict[str, float]:
  """Training-rollout statistics: success of ended actions and of sampled paths
  (`path_success`), returns, reward components, faults, cut episodes
  (`cut_metrics`), episodes past their first turn (`turn_metrics`), tool use
  (`tool_metrics`, environments with tools only), and with several agents their
  per-agent rewards and influence (`rollout.credit.credit_metrics`)."""
  ended = [a for node in tree.nodes for a in node.actions or [] if a is not None and a.ended]
  roots = [n for n in tree.nodes if n.parent_id < 0]
  paths = episodes(tree)  # one walk for the turn and tool metrics
  return {
      "rollout/success": sum(a.outcome > success_threshold for a in ended) / max(len(ended), 1),
      "rollout/path_success": path_success(tree, success_threshold),
      "rollout/return": float(
          np.mean([n.returns_B[n.valid_B].mean() for n in roots if n.valid_B.any()] or [np.nan])
      ),
      **turn_metrics(paths),
      **tool_metrics(tree, paths),
      **reward_metrics(tree),
      **fault_counts(tree),
      **cut_metrics(tree),
      **credit_metrics(tree),
  }


def path_results(tree) -> list[dict]:
  """Per root of a single-path tree (G = 1): outcome, return, turns, success inputs,
  whether the tree cut the episode (`is_cut`), and per agent its local reward of the
  ending joint action and whether the environment graded it alone there."""
  by_id = {n.node_id: n for n in tree.nodes}
  out = []
  for root in (n for n in tree.nodes if n.parent_id < 0):
    node, total, turns = root, 0.0, 0
    while True:
      total += float(node.rewards_B[0])
      turns += 1
      action = node.actions[0]
      child = int(node.children_B[0])
      if child < 0:
        break
      node = by_id[child]
    out.append(
        {
            "return": total,
            "outcome": action.outcome,
            "ended": action.ended,
            "turns": turns,
            "masked": not bool(node.valid_B[0]),
            "cut": is_cut(tree, node, 0),
            "local": [float(x) for x in node.local_BxN[0]],
            "local_graded": [bool(x) for x in node.local_graded_BxN[0]],
        }
    )
  return out


def engine_metrics(tree) -> dict[str, float]:
  """`engine/*` and `time/*` of the rollout that built `tree` (`expand_tree`):

  engine/slot_occupancy   decoding slots / all slots, mean over decode chunks
  engine/slot_parked      parked slots (caches kept for a continuation) / all slots, likewise
  engine/decode_chunks    decode chunks run (one device call each, every slot stepping)
  engine/prefill_tokens   prompt tokens prefilled (new tokens only where a cache was reused)
  engine/decode_tokens    tokens sampled
  engine/kv_reuse         share of the requests' context tokens served from a cache
  engine/decode_efficiency  sampled tokens / decoded slot-steps (padding and finished rows cost)
  engine/evictions        parked caches dropped for lack of slots
  time/generation, time/environment, time/overlap, time/device_idle, time/env_waiting
                          see `rollout.inflight.RolloutTimes`

  Both groups describe the schedule, which follows the environments' timing:
  they differ between two rollouts of one seed whose samples are identical
  (`metrics.RUN_BOUND_PREFIXES`).
  """
  stats, times = getattr(tree, "engine", None), getattr(tree, "times", None)
  out = {}
  if stats:
    ctx = stats["prefill_tokens"] + stats["reused_tokens"]
    out.update(
        {
            "engine/slot_occupancy": stats["occupancy_sum"] / max(stats["chunks"], 1),
            "engine/slot_parked": stats["parked_sum"] / max(stats["chunks"], 1),
            "engine/decode_chunks": float(stats["chunks"]),
            "engine/prefill_tokens": float(stats["prefill_tokens"]),
            "engine/decode_tokens": float(stats["decode_tokens"]),
            "engine/kv_reuse": stats["reused_tokens"] / max(ctx, 1),
            "engine/decode_efficiency": stats["decode_tokens"] / max(stats["slot_steps"], 1),
            "engine/evictions": float(stats["evictions"]),
        }
    )
  if times is not None:
    out.update(
        {
            f"time/{k}": float(getattr(times, k))
            for k in ("generation", "environment", "overlap", "device_idle", "env_waiting")
        }
    )
  return out
