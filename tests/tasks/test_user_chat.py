"""Reproducible model calls inside environments: an LLM user simulator and an LLM judge.

The `user_chat` task runs both on the tiny local model. Each environment step
gets a seed named by (step key, root, node, action, agent, turn), so the
thread pool's size and order change nothing, and the RL loop resumes exactly.
"""

import concurrent.futures
import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import calculator as calc_config
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.seeds import call_seed
from mtrl_jax.tasks.user_chat import UserChatFactory, user_chat_tasks
from mtrl_jax.testing import FakePolicy, byte_renderer
from mtrl_jax.train import rl


@pytest.fixture(scope="module")
def factory():
  # A hot simulator: the random tiny model's replies then depend on their seeds.
  return UserChatFactory(user_turns=2, max_new_tokens=6, temperature=3.0)


def _rollout(factory, workers, key=7):
  renderer = byte_renderer()
  transition = EnvTransition(renderer)
  policy = FakePolicy(vocab=123, low=97, max_new_tokens=5, stop_id=renderer.fmt.stop_ids[0])
  tasks = [user_chat_tasks("train")[i] for i in range(3)]
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    tree = expand_tree(TreeConfig(num_turns=2, num_generations=2), policy, transition,
                       transition.root_states(factory, tasks), jax.random.key(key),
                       executor=pool)
  return [(n.node_id, n.prompts, n.rewards_B.tolist(),
           [(a.steps[-1].details.get("env_turns"), a.steps[-1].details.get("grades"))
            for a in n.actions]) for n in tree.nodes]


def test_call_seed_is_a_stable_hash_of_its_parts():
  assert call_seed(1, "user_sim") == call_seed(1, "user_sim")
  assert len({call_seed(1, 2), call_seed(2, 1), call_seed(12), call_seed("1", 2)}) == 4
  assert call_seed(jax.random.key(3), 0) == call_seed(jax.random.key(3), 0)
  assert call_seed(jax.random.key(3), 0) != call_seed(jax.random.key(4), 0)
  assert 0 <= call_seed(5) < 2 ** 63
  with pytest.raises(TypeError, match="call_seed"):
    call_seed(1.5)


@pytest.mark.slow
def test_same_step_same_threads_and_grades_with_1_and_8_env_threads(factory):
  one = _rollout(factory, 1)
  eight = _rollout(factory, 8)
  assert one == eight
  user_texts = [t for _, _, _, infos in one for turns, _ in infos if turns for t in turns[0]]
  grades = [g["judge"]["score"] for _, _, _, infos in one for _, g in infos if g and "judge" in g]
  assert len(set(user_texts)) > 1, user_texts  # replies depend on their node's seed
  assert len(grades) >= 6 and all(0.0 <= g <= 1.0 for g in grades)
  assert _rollout(factory, 8, key=8) != one  # another step key: other replies


def _config(steps):
  c = calc_config.get_config("smoke=True")
  c.tokenizer.extra_specials = ""
  c.env.factory = "user_chat"
  c.env.kwargs = {"user_turns": 2, "max_new_tokens": 6, "temperature": 3.0}
  c.env.max_tokens = 200
  c.tasks.source = "user_chat"
  c.sft.steps = 0
  c.reward.step_penalty = 0.0  # rewards are then exactly the judge's P(PASS)
  c.reward.tool_penalty = 0.0
  c.rl.steps = steps
  c.rl.length_buckets = (256,)
  c.sampling.max_new_tokens = 8
  c.eval.greedy = False  # no held-out evaluation: it would only add compiles
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(RUN_BOUND_PREFIXES)}
            for line in f]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """A persistent compilation cache for this module's runs, as a resumed job on a
  machine with one has: later runs load the programs earlier ones compiled (seconds,
  not a minute). Programs and results are the same; the settings are restored."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  cc.reset_cache()
  jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update(names[1], 0.0)
  jax.config.update(names[2], 0)
  yield
  cc.reset_cache()
  for n, v in old.items():
    jax.config.update(n, v)


def _dump(workdir, step):
  with open(os.path.join(workdir, "rollouts", f"step_{step:06d}.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_rl_steps_with_llm_user_and_judge_resume_exactly(tmp_path, compile_cache):
  """Two RL steps in the real loop with the judge's grades as rewards; killed after
  step 2's metrics but before its checkpoint and resumed, the run's metrics and the
  simulated users' messages equal the uninterrupted run's."""
  full = str(tmp_path / "full")
  rl.run(_config(2), full, progress=False)
  judged = 0
  for node in _dump(full, 1):
    for reward, action in zip(node["rewards"], node["actions"]):
      scores = [s["grades"]["judge"]["score"] for s in action["steps"]
                if "judge" in s.get("grades", {})]
      if scores:
        judged += 1
        assert reward == pytest.approx(sum(scores), abs=1e-6)
        assert 0.0 < reward < 1.0
  assert judged >= 2
  rows = _rows(full)
  assert [r["step"] for r in rows] == [0, 1, 2] and "train/loss" in rows[1]
  assert rows[1]["reward/outcome"] > 0  # the judge's P(PASS) reached the rewards

  # The state a SIGKILL between step 2's metrics row and its checkpoint leaves.
  killed = str(tmp_path / "killed")
  shutil.copytree(full, killed)
  shutil.rmtree(os.path.join(killed, "ckpt", "2"))
  os.remove(os.path.join(killed, "rollouts", "step_000002.jsonl"))
  rl.run(_config(2), killed, progress=False)
  assert _rows(killed) == rows
  assert _dump(killed, 2) == _dump(full, 2)  # the user simulator said the same


@pytest.mark.slow
def test_rl_steps_with_qwen3_style_thinking_rewrites(tmp_path, compile_cache):
  """A short SFT teaches the <think> format; with strip_thinking the second user turn
  rewrites the history, and two RL steps train on the rewritten contexts. The steps
  make two updates per batch with truncated IS: the loop computes the trainer's own
  old logprobs, and the correction's metrics reach the log."""
  c = _config(2)
  c.rl.updates_per_step = 2
  c.loss.is_correction = "tis"
  c.tokenizer.extra_specials = "mtrl_jax.tasks.user_chat:THINK_SPECIALS"
  c.tokenizer.strip_thinking = True
  c.sft.steps = 20
  c.sft.conversations = "mtrl_jax.tasks.user_chat:thinking_conversation"
  c.sft.until_success = 0.0
  workdir = str(tmp_path / "run")
  rl.run(c, workdir, progress=False)
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert sum(r["text/history_rewrites"] for r in rows[1:]) > 0
  rewritten = [step for node in _dump(workdir, 1) + _dump(workdir, 2)
               for action in node["actions"] for step in action["steps"]
               if step.get("history_rewrites")]
  assert rewritten and all(step["valid"] for step in rewritten)
  for r in rows[1:]:
    assert np.isfinite(r["train/loss"]) and r["batch/actions"] > 0
    assert 0 < r["train/is_weight_mean"] <= 2.0 and r["train/sampler_gap"] < 1e-3
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    raw = [json.loads(line) for line in f]
  assert raw[2]["compiles/train_step"] == 2  # the update and the old-logprob forward
