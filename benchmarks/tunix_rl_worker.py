r"""Tunix 0.1.7 RL train-step timing worker (runs ONLY in the Tunix venv).

Command (a separate venv with google-tunix==0.1.7; this file never imports mtrl_jax):
  python3 -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix==0.1.7
  /tmp/tunix_venv/bin/python -m benchmarks.tunix_rl_worker '{"steps": 3, "warmup": 1}'

The JSON argument (every key optional) holds the model shape (layers, vocab, d_model, mlp,
heads, head_dim, kv_heads, rope_theta, eps; defaults = mtrl_jax's `bench` preset: 2-layer
Qwen3 shape, d_model 256, 4 heads of 64, 2 KV heads, MLP 768, vocab 8192, tied embeddings,
float32, random weights), prompt_len (32), new_tokens (64), num_prompts (4), generations (4),
beta (0.05), lr (1e-5), steps (3 timed steps), warmup (1), obs_len (8, agentic only),
max_concurrency (agentic only; default Tunix's own, 16) and workloads (["grpo", "agentic"],
a list or a comma-separated string). The model is Tunix's own `tunix.models.qwen3`; prompts
are random ids in [12, vocab) sent as space-separated text through an id-level tokenizer
(pad 0, eos 1).

Workloads, both through Tunix's own learners on one CPU device (actor, reference and
rollout colocated on one 1x1 ("fsdp", "tp") mesh, vanilla rollout = tunix Sampler, the
reference model a copy of the policy, beta > 0 so reference logprobs are computed, optax
adam lr 1e-5, one optimizer update per step):

* "grpo": tunix.rl.grpo.grpo_learner.GRPOLearner on an RLCluster. num_prompts x G prompts
  of prompt_len tokens, exactly new_tokens generated per row (eos_tokens=[-1], an id never
  sampled, so no row stops early), reward = parity of the first completion token read back
  from the decoded text. Timed: the whole `_run_global_step` (rollout + reward + advantage
  + reference logprobs + policy update). The split comes from wrapping RLCluster.generate /
  get_ref_per_token_logps / update_actor and the learner's _compute_rewards with wall
  clocks (blocking on the returned arrays); Tunix's own perf tracer is opt-in and not used.

* "agentic": tunix.rl.agentic.agentic_grpo_learner.GRPOLearner with ModelAgent (Tunix's
  default agent) and a 2-turn BaseTaskEnv: the agent gets the prompt_len-token prompt,
  generates new_tokens, the env answers with a fixed obs_len-token observation, the agent
  generates a second response of new_tokens, the env ends the episode with reward = parity
  of the first token of that response. The chat parser is a BaseChatTemplateParser with no
  control tokens (messages joined by spaces), so the id tokenizer round-trips the text.
  Tunix hands every turn the *remaining episode budget* (max_response_length minus tokens
  so far) as its generation limit; to get the 2 x new_tokens shape the learner's
  `_model_call` is subclassed only to cap that at new_tokens per turn, and
  max_response_length = 2 * new_tokens + obs_len + 1 (with exactly 2 * new_tokens +
  obs_len Tunix's engine hits its context limit right after the 2nd generation and drops
  that turn and its reward). Timed: the wall time between consecutive global-step
  boundaries (the learner pulls the next prompt batch right after each policy update and
  only then starts its rollouts, off_policy_steps=0), i.e. all 2 x G x num_prompts
  episodes + per-group reference/actor logprobs + advantages + the policy update.

Each figure is the median over `steps` steps after `warmup` steps (warm-up compiles);
tokens_per_s = generated (model-sampled) tokens per step / median step seconds.
The last stdout line is one JSON object; everything else (Tunix's logs, tqdm) goes to
stderr. A workload that fails is reported as {"error": "..."}. Runtime: ~1 minute on 2
CPU cores for both workloads with steps=3.

Tunix 0.1.7 behaviours worth knowing when comparing: the vanilla rollout passes
RolloutConfig.seed (None) to the Sampler, which then uses PRNGKey(0) on every call, so in
the agentic learner (one row per call) the G members of a group sample identical tokens
(reported as distinct_rows in train_examples); the agentic trainer-logprob diagnostic
reads the anchor policy snapshot, which is only refreshed by sync_weights and so stays at
the initial weights when actor and rollout share weights (as here).
"""

import contextlib
import copy
import json
import os
import statistics
import sys
import threading
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULTS = dict(
    layers=2,
    vocab=8192,
    d_model=256,
    mlp=768,
    heads=4,
    head_dim=64,
    kv_heads=2,
    rope_theta=10000.0,
    eps=1e-6,
    prompt_len=32,
    new_tokens=64,
    num_prompts=4,
    generations=4,
    beta=0.05,
    lr=1e-5,
    steps=3,
    warmup=1,
    obs_len=8,
    max_concurrency=None,
    workloads=["grpo", "agentic"],
)
FIRST_ID = 12  # prompt / observation ids are drawn from [FIRST_ID, vocab)


class IdTokenizer:
  """Id-level tokenizer: text is space-separated ids; 0 = pad, 1 = eos."""

  def encode(self, text, **kw):
    del kw
    return [int(x) for x in str(text).split()]

  def decode(self, ids, **kw):
    del kw
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0

  def eos_id(self):
    return 1

  def pad_id(self):
    return 0


def parse_args(argv):
  user = json.loads(argv[1]) if len(argv) > 1 and argv[1].strip() else {}
  if "workload" in user and "workloads" not in user:
    user["workloads"] = user.pop("workload")
  a = dict(DEFAULTS)
  a.update(user)
  if isinstance(a["workloads"], str):
    a["workloads"] = [w.strip() for w in a["workloads"].split(",") if w.strip()]
  return a


def build_model(a):
  from tunix.models.qwen3 import model as qmodel  # pylint: disable=g-import-not-at-top

  cfg = qmodel.ModelConfig(
      num_layers=a["layers"],
      vocab_size=a["vocab"],
      embed_dim=a["d_model"],
      hidden_dim=a["mlp"],
      num_heads=a["heads"],
      head_dim=a["head_dim"],
      num_kv_heads=a["kv_heads"],
      rope_theta=int(a["rope_theta"]),
      norm_eps=a["eps"],
      use_tied_embedding=True,
  )
  policy = qmodel.Qwen3(cfg, rngs=nnx.Rngs(0))
  graph, params = nnx.split(policy)
  reference = nnx.merge(graph, jax.tree.map(jnp.copy, params))  # as tunix/cli/grpo_main.py
  return policy, reference


class PhaseClock:
  """Wall-clock events of wrapped RLCluster / learner methods, bucketed into steps later."""

  def __init__(self):
    self.events = []  # (phase, t0, t1, extra dict)
    self.lock = threading.Lock()

  def wrap(self, obj, name, phase, block=None, extra=None):
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      if block is not None:
        block(out)
      t1 = time.perf_counter()
      ex = extra(args, kwargs, out) if extra is not None else {}
      with self.lock:
        self.events.append((phase, t0, t1, ex))
      return out

    setattr(obj, name, wrapped)

  def summarize(self, t_begin, t_end):
    """Per-phase count / summed seconds / first-start-to-last-end span inside a window."""
    out = {}
    for phase, t0, t1, ex in self.events:
      if not t_begin <= t0 < t_end:
        continue
      d = out.setdefault(phase, {"calls": 0, "sum_s": 0.0, "first": t0, "last": t1})
      d["calls"] += 1
      d["sum_s"] += t1 - t0
      d["first"], d["last"] = min(d["first"], t0), max(d["last"], t1)
      for k, v in ex.items():
        d[k] = d.get(k, 0) + v
    for d in out.values():
      d["span_s"] = d.pop("last") - d.pop("first")
    return out


def _rollout_extra(args, kwargs, out):
  prompts = kwargs.get("prompts", args[0] if args else [])
  if isinstance(prompts, str):  # the agentic learner passes one rendered string
    prompts = [prompts]
  return {
      "rows": len(out.tokens),
      "generated_tokens": int(sum(len(t) for t in out.tokens)),
      "prompt_tokens": int(sum(len(str(p).split()) for p in prompts)),
  }


def instrument(clock, rl_cluster, learner):
  clock.wrap(rl_cluster, "generate", "rollout", extra=_rollout_extra)
  clock.wrap(
      rl_cluster,
      "get_ref_per_token_logps",
      "ref_logps",
      block=jax.block_until_ready,
      extra=lambda a, k, o: {"rows": int(o.shape[0])},
  )
  clock.wrap(
      rl_cluster,
      "get_actor_per_token_logps",
      "actor_logps",
      block=jax.block_until_ready,
      extra=lambda a, k, o: {"rows": int(o.shape[0])},
  )
  model = rl_cluster.actor_trainer.model
  clock.wrap(
      rl_cluster,
      "update_actor",
      "policy_update",
      block=lambda _: jax.block_until_ready(nnx.state(model, nnx.Param)),
  )
  clock.wrap(learner, "_compute_rewards", "reward")


def record_train_examples(rl_cluster):
  """Records every TrainExample the update consumes (host copies of ids/masks, ~ms/step)."""
  consumed = []
  inner_update = rl_cluster.update_actor

  def recording_update(train_ds, *args, **kwargs):
    for ex in train_ds:
      ids = np.asarray(ex.completion_ids)
      consumed.append(
          {
              "rows": int(ids.shape[0]),
              "prompt_cols": int(ex.prompt_ids.shape[1]),
              "completion_cols": int(ids.shape[1]),
              "loss_mask_tokens": int(np.asarray(ex.completion_mask).sum()),
              "distinct_rows": len({r.tobytes() for r in ids}),
          }
      )
    return inner_update(train_ds, *args, **kwargs)

  rl_cluster.update_actor = recording_update
  return consumed


def make_cluster(a, policy, reference, rollout_config, mesh):
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=g-import-not-at-top

  role = rl_cluster_lib.Role
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role.ACTOR: mesh, role.REFERENCE: mesh, role.ROLLOUT: mesh},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adam(a["lr"]),
          eval_every_n_steps=10**9,
          max_steps=a["warmup"] + a["steps"],
      ),
      rollout_config=rollout_config,
  )
  return rl_cluster_lib.RLCluster(
      actor=policy, reference=reference, tokenizer=IdTokenizer(), cluster_config=cluster_config
  )


def random_batches(a, seed, stamps=None):
  """Endless batches of num_prompts random-id prompts; optionally stamps each pull."""
  rng = np.random.default_rng(seed)
  while True:
    if stamps is not None:
      stamps.append(time.perf_counter())
    yield {
        "prompts": np.array(
            [
                " ".join(map(str, rng.integers(FIRST_ID, a["vocab"], a["prompt_len"])))
                for _ in range(a["num_prompts"])
            ]
        )
    }


def first_token_parity(text):
  ids = str(text).split()
  return float(int(ids[0]) % 2 == 0) if ids else 0.0


def _step_report(a, clock, windows, consumed):
  """Timings of the (start, end) step windows after warm-up, with the phase split."""
  durations = [t1 - t0 for t0, t1 in windows]
  timed = durations[a["warmup"] :]
  med = statistics.median(timed)
  per_step = [clock.summarize(t0, t1) for t0, t1 in windows[a["warmup"] :]]
  gen = [p.get("rollout", {}).get("generated_tokens", 0) for p in per_step]
  phases = {}
  for name in sorted({k for p in per_step for k in p}):
    vals = [p[name] for p in per_step if name in p]
    phases[name] = {
        "calls_per_step": statistics.median([v["calls"] for v in vals]),
        "median_sum_s": round(statistics.median([v["sum_s"] for v in vals]), 4),
        "median_span_s": round(statistics.median([v["span_s"] for v in vals]), 4),
    }
    for k in ("rows", "generated_tokens", "prompt_tokens"):
      if k in vals[0]:
        phases[name][k + "_per_step"] = statistics.median([v[k] for v in vals])
  gen_med = statistics.median(gen)
  return {
      "step_s_median": round(med, 4),
      "step_s_all": [round(d, 4) for d in durations],
      "warmup_steps": a["warmup"],
      "timed_steps": len(timed),
      "sequences_per_step": a["num_prompts"] * a["generations"],
      "generated_tokens_per_step": gen_med,
      "generated_tokens_per_step_all": gen,
      "tokens_per_s": round(gen_med / med, 2),
      "phases": phases,
      "train_examples": consumed,
  }


def run_grpo(a, mesh):
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top

  policy, reference = build_model(a)
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=a["new_tokens"],
      max_prompt_length=a["prompt_len"],
      kv_cache_size=a["prompt_len"] + a["new_tokens"],
      temperature=1.0,
      top_p=1.0,
      top_k=None,
      eos_tokens=[-1],
  )
  cluster = make_cluster(a, policy, reference, rollout_config, mesh)

  def parity_reward(prompts, completions, **kwargs):
    del prompts, kwargs
    return [first_token_parity(c) for c in completions]

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      algo_config=grpo_learner.GRPOConfig(
          num_generations=a["generations"], num_iterations=1, beta=a["beta"]
      ),
      reward_fns=[parity_reward],
  )
  clock = PhaseClock()
  instrument(clock, cluster, learner)
  consumed = record_train_examples(cluster)
  windows = []
  inner = learner._run_global_step  # pylint: disable=protected-access

  def timed_global_step(*args, **kwargs):
    t0 = time.perf_counter()
    inner(*args, **kwargs)
    windows.append((t0, time.perf_counter()))

  learner._run_global_step = timed_global_step  # pylint: disable=protected-access
  learner.train(random_batches(a, seed=0))
  if len(windows) != a["warmup"] + a["steps"]:
    raise RuntimeError(f"expected {a['warmup'] + a['steps']} global steps, got {len(windows)}")
  rep = _step_report(a, clock, windows, consumed)
  rep["notes"] = (
      "one RLCluster.generate call per step on all num_prompts*G rows (Tunix repeats each "
      "prompt G times; no shared-prefix prefill); reference logprobs every step (beta>0) in "
      "one forward over all rows; num_iterations=1 so no old-policy logprob pass; one "
      "optimizer update on one micro-batch of all rows (mini_batch = train_micro_batch = "
      "full batch); the policy loss recomputes policy logprobs in its forward+backward"
  )
  rep["config"] = {
      "rollout_micro_batch_rows": a["num_prompts"] * a["generations"],
      "kv_cache_size": rollout_config.kv_cache_size,
      "eos_tokens": rollout_config.eos_tokens,
      "reward_mode": "first completion token parity",
  }
  return rep


def run_agentic(a, mesh):
  from tunix.rl.agentic import agentic_grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.agentic.agents import model_agent  # pylint: disable=g-import-not-at-top
  from tunix.rl.agentic.environments import base_environment  # pylint: disable=g-import-not-at-top
  from tunix.rl.agentic.parser.chat_template_parser import parser as parser_lib
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top

  new, obs_len, plen = a["new_tokens"], a["obs_len"], a["prompt_len"]
  max_response = 2 * new + obs_len + 1
  obs_text = " ".join(map(str, np.random.default_rng(123).integers(FIRST_ID, a["vocab"], obs_len)))

  class IdChatParser(parser_lib.BaseChatTemplateParser):
    """No control tokens: messages are joined by a space, so ids round-trip exactly."""

    def _init_tokens(self):
      return parser_lib.TokenConfig(message_separator=" ")

    def _init_generation_prompt(self):
      return ""

  class TwoTurnEnv(base_environment.BaseTaskEnv):
    """Turn 1 -> fixed obs_len-token observation; turn 2 -> done, reward = token parity."""

    def __init__(self, single_example, **kwargs):
      super().__init__(task=single_example, reward_fn=None, max_steps=2, **kwargs)

    def _initial_observation(self):
      p = self.task["prompts"]
      return {"prompts": str(np.asarray(p).reshape(-1)[0])}

    def _step_impl(self, action):
      text = getattr(action, "action", action)
      if self.step_count == 1:
        return base_environment.EnvStepResult(observation=obs_text, reward=0.0, done=False, info={})
      return base_environment.EnvStepResult(
          observation={}, reward=first_token_parity(text), done=True, info={}
      )

  class PerTurnCapLearner(agentic_grpo_learner.GRPOLearner):
    """Tunix's agentic GRPO learner; only caps each turn's generation at new_tokens."""

    def _model_call(self, chat_lists, env=None, max_generation_steps=None):
      if max_generation_steps is not None:
        max_generation_steps = min(max_generation_steps, new)
      return super()._model_call(chat_lists, env, max_generation_steps=max_generation_steps)

  # Turn 2 re-prefills prompt + turn 1 + observation; the Sampler pads that prompt to the
  # next power of two, so the KV cache must hold next_pow2(plen + new + obs_len) + new.
  turn2_prompt = 1 << (plen + new + obs_len - 1).bit_length()
  policy, reference = build_model(a)
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=max_response,
      max_prompt_length=plen,
      kv_cache_size=max(plen, turn2_prompt) + new,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
      eos_tokens=[-1],
      return_logprobs=True,
  )
  cluster = make_cluster(a, policy, reference, rollout_config, mesh)
  algo_kwargs = dict(
      num_generations=a["generations"],
      num_iterations=1,
      beta=a["beta"],
      max_response_length=max_response,
  )
  if a.get("max_concurrency"):
    algo_kwargs["max_concurrency"] = int(a["max_concurrency"])
  algo = agentic_grpo_learner.GRPOConfig(**algo_kwargs)
  learner = PerTurnCapLearner(
      rl_cluster=cluster,
      algo_config=algo,
      reward_fns=None,
      chat_parser=IdChatParser(IdTokenizer()),
      agent_class=model_agent.ModelAgent,
      env_class=TwoTurnEnv,
  )
  clock = PhaseClock()
  instrument(clock, cluster, learner)
  consumed = record_train_examples(cluster)
  stamps = []
  learner.train(random_batches(a, seed=1, stamps=stamps))
  n = a["warmup"] + a["steps"]
  if len(stamps) < n + 1:
    raise RuntimeError(f"expected {n + 1} batch pulls, got {len(stamps)}")
  windows = list(zip(stamps[:n], stamps[1 : n + 1]))
  rep = _step_report(a, clock, windows, consumed)
  rep["notes"] = (
      "every agent turn is its own RLCluster.generate call with ONE prompt row (the "
      "orchestrator runs up to max_concurrency episodes in threads): 2*num_prompts*G generate "
      "calls per step; each turn re-renders and re-tokenizes the whole conversation and "
      "re-prefills it from scratch (no KV reuse across turns; turn-2 prompt = prompt + "
      "turn-1 response + observation, padded to the next power of two); groups are "
      "processed one at a time as they finish: per group one reference-logprob forward (beta>0) "
      "and one trainer-logprob forward of the actor (a 'sampler vs trainer' diagnostic, "
      "use_rollout_logps=True so the PPO ratio uses the sampler's logprobs); then one "
      "optimizer update on all num_prompts*G rows (prompt + [turn1, obs, turn2] with the obs "
      "masked out of the loss)"
  )
  rep["config"] = {
      "max_response_length": max_response,
      "per_turn_cap": new,
      "obs_len": obs_len,
      "kv_cache_size": rollout_config.kv_cache_size,
      "turn2_padded_prompt_len": turn2_prompt,
      "max_concurrency": algo.max_concurrency,
      "rollout_seed": "None -> Sampler uses PRNGKey(0) on every call",
      "reward_mode": "env reward at episode end: parity of turn-2 first token",
  }
  return rep


def main(argv):
  a = parse_args(argv)
  result = {"tunix_version": None, "device": None, "args": a, "workloads": {}}
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top

    result["tunix_version"] = metadata.version("google-tunix")
  except Exception:  # pylint: disable=broad-except
    pass
  dev = jax.devices()[0]
  result["device"] = f"{dev.platform} x1 (of {jax.device_count()}), {os.cpu_count()} cores"
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  runners = {"grpo": run_grpo, "agentic": run_agentic}
  for name in a["workloads"]:
    t0 = time.perf_counter()
    try:
      if name not in runners:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(runners)}")
      # Tunix logs/tqdm must not reach stdout: the last stdout line is the JSON result.
      with contextlib.redirect_stdout(sys.stderr):
        rep = runners[name](copy.deepcopy(a), mesh)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc(file=sys.stderr)
      rep = {"error": f"{type(e).__name__}: {e}"}
    rep["wall_s_total"] = round(time.perf_counter() - t0, 1)
    result["workloads"][name] = rep
  sys.stdout.write(json.dumps(result) + "\n")
  sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv)
