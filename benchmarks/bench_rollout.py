r"""Tree-rollout throughput: frontier batching + prefix branching vs node by node.

One tree step (T=2, G=4, 8 roots; N=1 and N=2 align with one parameter state
per agent) is generated twice with the same model, sampler and scripted
token-level environment:

  batched      the engine's way: every (node, agent) prompt of a level in one
               `Sampler.generate` call per agent state, each prompt prefilled
               once and forked into G continuations;
  node-by-node the CoMLRL way: one generate call per (node, agent), the prompt
               repeated G times so each sample is prefilled separately.

Both run once untimed (compilation), then `--repeats` timed runs; the table
reports the median wall time, generated tokens/s and the speed-up. Completions
never stop early (no stop ids), so both methods generate the same number of
tokens.

Command (CPU, about 2 minutes on 2 cores):
  .venv/bin/python -m benchmarks.bench_rollout --preset=small
GPU: add --preset=bench.

Measured on this project's 2-core CPU machine, shared with other jobs
(preset small, 3 repeats): N=1 0.90 s vs 1.63 s (1.81x), N=2 2.80 s vs 3.94 s
(1.41x). On CPU decoding is compute bound (for `small`, one decode step cost
about 0.15 ms per row at 4 rows and 0.11 ms per row at 128), so the gain is
prefill sharing plus a little batching efficiency; the 3x target assumes an
accelerator, where a small batch leaves the device idle. Not measured here.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
from absl import app, flags
from flax import nnx

from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import Completion, SamplerPolicy, TreeConfig, expand_tree, plan_tree
from mtrl_jax.testing import TokenTransition
from mtrl_jax.sampling import Sampler, SamplingConfig

_PRESET = flags.DEFINE_string("preset", "small", "model preset ('small' on CPU, 'bench' on GPU)")
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype (e.g. bfloat16)")
_ROOTS = flags.DEFINE_integer("roots", 8, "tasks (trees) per step")
_TURNS = flags.DEFINE_integer("turns", 2, "T")
_GENS = flags.DEFINE_integer("generations", 4, "G")
_AGENTS = flags.DEFINE_list("agents", ["1", "2"], "N values to benchmark (align)")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "root prompt tokens")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per completion")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per method")


class NodeByNodePolicy(SamplerPolicy):
  """CoMLRL-style sampling: one generate call per (node, agent), G separate prefills."""

  def sample(self, prompts, agent_ids, num_generations, key):
    out = []
    for p, (prompt, agent) in enumerate(zip(prompts, agent_ids)):
      res = self.sampler.generate(self.states[self.state_index(agent)],
                                  [list(prompt)] * num_generations, 1, self.sampling,
                                  jax.random.fold_in(key, p), self.stop_ids, self.pad_id)
      self.num_generate_calls += 1
      out.append([Completion(res.tokens[g, :res.lengths[g]], res.logprobs[g, :res.lengths[g]],
                             res.finish_reason[g]) for g in range(num_generations)])
    return out


def _time_methods(cfg, sampler, policies, transition, roots, repeats):
  """Median wall time per method; methods alternate so machine load hits all alike."""
  key = jax.random.key(0)
  for policy in policies.values():
    expand_tree(cfg, policy, transition, roots, key)  # compile every shape
  compiles = sampler.num_compiles
  walls = {name: [] for name in policies}
  stats = {}
  for r in range(repeats):
    for name, policy in policies.items():
      calls0 = policy.num_generate_calls
      t0 = time.perf_counter()
      tree = expand_tree(cfg, policy, transition, roots, jax.random.fold_in(key, r + 1))
      walls[name].append(time.perf_counter() - t0)
      tokens = sum(len(c.ids) for n in tree.nodes for a in n.completions for c in a)
      stats[name] = (tokens, policy.num_generate_calls - calls0, tree.counts()["nodes"])
  if sampler.num_compiles != compiles:
    raise RuntimeError(f"the sampler recompiled during timing ({compiles} -> "
                       f"{sampler.num_compiles} programs): timings include compilation")
  return {name: (statistics.median(walls[name]),) + stats[name] for name in policies}


def main(argv):
  del argv
  model_cfg = get_preset(_PRESET.value, dtype=_DTYPE.value)
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=_NEW.value)
  transition = TokenTransition(model_cfg.vocab_size)
  print("command:", " ".join([sys.executable] + sys.argv))
  print(f"device: {jax.devices()[0].device_kind}  preset: {_PRESET.value}  "
        f"T={_TURNS.value} G={_GENS.value} roots={_ROOTS.value} "
        f"max_new_tokens={_NEW.value} root prompt={_PROMPT_LEN.value}")
  header = (f"{'N':>2} {'method':<13} {'nodes':>5} {'calls':>5} {'tokens':>7} "
            f"{'wall s':>8} {'tok/s':>9} {'speedup':>7}")
  print(header)
  print("-" * len(header))
  for n in [int(a) for a in _AGENTS.value]:
    cfg = TreeConfig(num_turns=_TURNS.value, num_generations=_GENS.value, num_agents=n)
    plan = plan_tree(cfg, _ROOTS.value, _PROMPT_LEN.value + _TURNS.value * (_NEW.value + 8),
                     _NEW.value)
    states = [nnx.split(create_model(model_cfg, seed=i))[1] for i in range(n)]
    states = states if n > 1 else states[0]
    sampler = Sampler(model_cfg)
    roots = transition.roots(_ROOTS.value, n, _PROMPT_LEN.value)
    policies = {name: cls(sampler, states, sampling, stop_ids=(), pad_id=0)
                for name, cls in (("batched", SamplerPolicy), ("node-by-node", NodeByNodePolicy))}
    rows = _time_methods(cfg, sampler, policies, transition, roots, _REPEATS.value)
    base = rows["node-by-node"][0]
    for name, (wall, tokens, calls, nodes) in rows.items():
      assert nodes == plan.nodes and tokens == plan.generations * _NEW.value
      print(f"{n:>2} {name:<13} {nodes:>5} {calls:>5} {tokens:>7} {wall:>8.3f} "
            f"{tokens / wall:>9.0f} {base / wall:>6.2f}x")


if __name__ == "__main__":
  app.run(main)
