"""The fixed set of array shapes an RL run uses, and compiling all of them up front.

A jitted function compiles once per shape bucket (DESIGN.md invariant 5). With
power-of-two buckets the set of shapes an RL run meets depends on the policy
(how many actions are still calling tools, how long the prompts grew), so new
programs keep appearing late in a run. `plan_shapes` instead derives a small
set of buckets from the config alone:

  sampler rows      the sizes of the tree's levels (roots * B^t prompts, times
                    N agents and G samples), the tool-call sub-step rounds
                    (one prompt per action) and the evaluation batches;
  sampler prompts   `rl.prompt_buckets` (default: `rl.length_buckets`);
  train rows        rl.packing='rows': a quarter, a half and all of the
                    tree's rows (the zero-variance filter keeps a
                    policy-dependent subset); 'tree': all of the tree's rows
                    (the row layout's count bounds the packed one) halved
                    down to a 32nd, since packed trees fill few rows;
  train lengths     'rows': `rl.length_buckets`; 'tree': the largest of them
                    (bin packing fills rows, so one length serves);
  trained tokens    'tree' only: a quarter, a half or all of the row length
                    (`tree_packing.logit_buckets`): the LM head runs there.

`precompile` then compiles every (call kind, row bucket, prompt bucket) of the
sampler and every (rows, length) of the train step before the first RL step,
so the compile census stays flat for the rest of the run.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from mtrl_jax.buckets import bucket, round_up
from mtrl_jax.rollout import plan_tree
from mtrl_jax.rollout.packing import batch_spec
from mtrl_jax.rollout.policy import StackedStates
from mtrl_jax.rollout.tree_packing import logit_buckets, tree_batch_spec
from mtrl_jax.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class SamplerCall:
  """One kind of sampler call: its sampling settings, G and the largest prompt count."""

  sampling: SamplingConfig
  num_generations: int
  max_prompts: int


@dataclasses.dataclass(frozen=True)
class ShapePlan:
  """Buckets of one RL run (see the module docstring)."""

  sampler_rows: tuple
  prompt_lens: tuple
  train_rows: tuple
  train_lens: tuple
  calls: tuple  # SamplerCall
  packing: str = "rows"

  def sampler_programs(self) -> list[tuple[SamplerCall, int, int]]:
    """(call, prompt-row bucket, prompt-length bucket) of every sampler program."""
    out = []
    for call in self.calls:
      for p in self.sampler_rows:
        if p <= bucket(call.max_prompts, self.sampler_rows, "sampler prompt rows"):
          out.extend((call, p, lp) for lp in self.prompt_lens)
    return out

  def train_shapes(self) -> list[tuple[int, ...]]:
    """(rows, length) of every train program, plus trained tokens per row for 'tree'."""
    if self.packing == "tree":
      return [(b, l, k) for b in self.train_rows for l in self.train_lens
              for k in logit_buckets(l)]
    return [(b, l) for b in self.train_rows for l in self.train_lens]

  def train_specs(self) -> list[dict]:
    """The batch specs (`jax.ShapeDtypeStruct`s) of every train program."""
    spec = tree_batch_spec if self.packing == "tree" else batch_spec
    return [spec(*shape) for shape in self.train_shapes()]


def plan_shapes(exp, row_multiple: int, sampler_shards: int) -> ShapePlan:
  """The buckets of an experiment (`train.experiment.Experiment`)."""
  rl, sft, ev, tree = exp.rl, exp.sft, exp.eval, exp.tree
  g, n = tree.num_generations, tree.num_agents
  plan = plan_tree(tree, rl.roots_per_step, rl.max_length, exp.sampling.max_new_tokens)
  greedy = dataclasses.replace(exp.sampling, greedy=True)
  # Prompt counts of each kind of call: a level's first call (all its nodes'
  # prompts, per agent state or all agents in one call), a sub-step round (one
  # prompt per action), the evaluations (G = 1). Separate policies sample every
  # agent in one stacked call whose rows count one agent's prompts.
  m = 1 if not exp.agents.share_policy else n
  calls = []
  first = sorted({nodes * m for nodes in plan.level_nodes} | set(plan.level_nodes))
  calls.append(SamplerCall(exp.sampling, g, max(first)))
  if tree.shape == "chain" and tree.num_turns > 1:  # below the roots: G = 1 per node
    calls.append(SamplerCall(exp.sampling, 1, max(first)))
  counts = set(first)
  if tree.substeps:  # one continuation per action: G = 1 over up to a level's samples
    calls.append(SamplerCall(exp.sampling, 1, plan.max_level_generations))
    counts.update(c * g for c in first)
  eval_sizes = [ev.num_tasks * m]
  counts.update(eval_sizes)
  if sft.steps and sft.until_success > 0:
    check = sft.check_tasks * m
    eval_sizes.append(check)
    if check > max(counts):  # else padded up to a bucket above: no program of its own
      counts.add(check)
  if ev.greedy or (sft.steps and sft.until_success > 0):
    calls.append(SamplerCall(greedy, 1, max(eval_sizes)))
  if ev.sampled:
    sampled = dataclasses.replace(exp.sampling, greedy=False, temperature=1.0, top_p=1.0,
                                  top_k=0)
    calls.append(SamplerCall(sampled, 1, max(eval_sizes)))
  prompt_rows = {round_up(c, sampler_shards) for c in counts}
  # Decode rows are the bucket of (prompt-row bucket) x G.
  decode_rows = {round_up(p * c.num_generations, sampler_shards) for c in calls
                 for p in prompt_rows if p <= bucket(c.max_prompts, prompt_rows, "sampler prompt rows")}
  sampler_rows = tuple(sorted(prompt_rows | decode_rows))
  prompt_lens = rl.prompt_buckets or rl.length_buckets
  total = plan.rows
  if rl.packing == "tree":
    fractions, train_lens = (32, 16, 8, 4, 2, 1), (rl.max_length,)
  else:
    fractions, train_lens = (4, 2, 1), tuple(rl.length_buckets)
  train_rows = tuple(sorted({round_up(max(total // d, 1), row_multiple) for d in fractions}))
  return ShapePlan(sampler_rows=sampler_rows, prompt_lens=tuple(prompt_lens),
                   train_rows=train_rows, train_lens=train_lens, calls=tuple(calls),
                   packing=rl.packing)


def per_process(exp, num_processes: int):
  """`exp` as one of `num_processes` processes plans it: its share of the roots,
  held-out tasks and SFT check tasks (the largest share when they do not divide)."""
  if num_processes == 1:
    return exp
  share = lambda n: -(-n // num_processes)
  return dataclasses.replace(
      exp, rl=dataclasses.replace(exp.rl, roots_per_step=share(exp.rl.roots_per_step)),
      eval=dataclasses.replace(exp.eval, num_tasks=share(exp.eval.num_tasks)),
      sft=dataclasses.replace(exp.sft, check_tasks=share(exp.sft.check_tasks)))


def precompile(shapes: ShapePlan, sampler, sampler_state, train_step, num_stop_ids: int) -> dict:
  """Compiles every sampler and train-step program of `shapes`; returns counts and seconds.

  `sampler_state`: the shared policy's params, or `StackedStates` (separate
  policies: the stacked programs of `Sampler.generate_stacked`)."""
  t0 = time.perf_counter()
  programs = shapes.sampler_programs()
  stacked = isinstance(sampler_state, StackedStates)
  for call, p, lp in programs:
    if stacked:  # separate policies: every call samples all agents at once
      sampler.precompile_stacked(sampler_state.params, p, lp, call.num_generations,
                                 call.sampling, num_stop_ids=num_stop_ids)
    else:
      sampler.precompile(sampler_state, p, lp, call.num_generations, call.sampling,
                         num_stop_ids=num_stop_ids)
  t1 = time.perf_counter()
  agents = getattr(train_step, "num_agents", None)  # a StackedTrainStep: [A, ...] batches
  for spec in shapes.train_specs():
    if agents is not None:
      spec = {k: jax.ShapeDtypeStruct((agents,) + v.shape, v.dtype) for k, v in spec.items()}
    train_step.precompile(spec)
  t2 = time.perf_counter()
  return {"sampler_programs": len(programs), "sampler_seconds": round(t1 - t0, 1),
          "train_programs": len(shapes.train_shapes()), "train_seconds": round(t2 - t1, 1)}
