"""Reproducible model calls inside environments: an LLM user simulator and an LLM judge.

The `user_chat` task runs both on the tiny local model. Each environment step
gets a seed named by (step key, root, node, action, agent, turn), so the
thread pool's size and order change nothing, and the RL loop resumes exactly.
"""

import concurrent.futures
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import calculator as calc_config
from mtrl_jax import metrics as metrics_lib
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.run import rl
from mtrl_jax.seeds import call_seed
from mtrl_jax.tasks.user_chat import UserChatFactory, user_chat_tasks
from mtrl_jax.testing import FakePolicy, built_once, byte_renderer


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
    tree = expand_tree(
        TreeConfig(num_turns=2, num_generations=2),
        policy,
        transition,
        transition.root_states(factory, tasks),
        jax.random.key(key),
        executor=pool,
    )
  return [
      (
          n.node_id,
          n.prompts,
          n.rewards_B.tolist(),
          [
              (a.steps[-1].details.get("env_turns"), a.steps[-1].details.get("grades"))
              for a in n.actions
          ],
      )
      for n in tree.nodes
  ]


def _blake2b_seed(*encoded: bytes) -> int:
  """call_seed's documented construction from scratch: blake2b (8-byte digest) over each
  part as a 4-byte little-endian length and a type-tagged encoding, the low 63 bits."""
  h = hashlib.blake2b(digest_size=8)
  for data in encoded:
    h.update(len(data).to_bytes(4, "little") + data)
  return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def test_call_seed_is_a_stable_hash_of_its_parts():
  # Pinned values: the same parts give these seeds in every process and release.
  assert call_seed(1, "user_sim") == 3733418965774598957
  assert call_seed(jax.random.key(3), 0) == 6457610698881384090
  assert call_seed(1, "user_sim") == _blake2b_seed(b"i1", b"suser_sim")
  key_data = np.array([0, 3], np.uint32).tobytes()  # jax.random.key(3)'s threefry data
  assert call_seed(jax.random.key(3), 0) == _blake2b_seed(b"k" + key_data, b"i0")
  assert call_seed(jax.random.PRNGKey(3), 0) == call_seed(jax.random.key(3), 0)  # raw key
  # Order, grouping and the type of a part all count.
  seeds = {
      call_seed(1, 2),
      call_seed(2, 1),
      call_seed(12),
      call_seed("1", 2),
      call_seed(b"1", 2),
      call_seed(1, 2, 0),
      call_seed(jax.random.key(4), 0),
  }
  assert len(seeds) == 7
  assert call_seed(jax.random.key(3), 0) != call_seed(jax.random.key(4), 0)
  assert all(0 <= s < 2**63 for s in seeds)
  with pytest.raises(TypeError, match="call_seed"):
    call_seed(1.5)
  with pytest.raises(TypeError, match="bool"):
    call_seed(True)


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


def _config():
  """Two RL steps on user_chat with the judge's grades as rewards (no step or tool
  penalty: a reward is exactly the judge's P(PASS)). A short SFT teaches a thinking
  model's <think> format, which strip_thinking hides once the next user turn arrives
  (the second user turn rewrites the history); each step makes two updates with
  truncated IS (the loop computes the trainer's own old logprobs)."""
  c = calc_config.get_config("smoke=True")
  c.tokenizer.extra_specials = "mtrl_jax.tasks.user_chat:THINK_SPECIALS"
  c.tokenizer.strip_thinking = True
  c.env.factory = "user_chat"
  c.env.kwargs = {"user_turns": 2, "max_new_tokens": 6, "temperature": 3.0}
  c.env.max_tokens = 200
  c.tasks.source = "user_chat"
  c.sft.steps = 20
  c.sft.conversations = "mtrl_jax.tasks.user_chat:thinking_conversation"
  c.sft.until_success = 0.0
  c.reward.step_penalty = 0.0
  c.reward.tool_penalty = 0.0
  c.rl.steps = 2
  c.rl.updates_per_step = 2
  c.loss.is_correction = "tis"
  c.rl.length_buckets = (256,)
  c.sampling.max_new_tokens = 8
  c.eval.greedy = False  # no held-out evaluation: it would only add compiles
  return c


def _rows(workdir, run_bound=False):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if run_bound or not k.startswith(RUN_BOUND_PREFIXES)
        }
        for line in f
    ]


def _dump(workdir, step):
  with open(os.path.join(workdir, "rollouts", f"step_{step:06d}.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(full, resumed): the run of `_config` to its end, and a copy in the state a SIGKILL
  between step 2's metrics row and its checkpoint leaves, resumed. Neither draws
  curves.png (matplotlib takes over a second of CPU per run; nothing here reads it)."""

  def train(root):
    full, killed = os.path.join(root, "full"), os.path.join(root, "killed")
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(metrics_lib, "plot_metrics", lambda *args, **kwargs: None)
      rl.run(_config(), full, progress=False)
      shutil.copytree(full, killed)
      shutil.rmtree(os.path.join(killed, "ckpt", "2"))
      os.remove(os.path.join(killed, "rollouts", "step_000002.jsonl"))
      rl.run(_config(), killed, progress=False)

  # Built once per `pytest` run: the first xdist worker to ask builds it, the others reuse it.
  root = built_once(tmp_path_factory, "user_chat_runs", train)
  return os.path.join(root, "full"), os.path.join(root, "killed")


@pytest.mark.slow
def test_rl_steps_take_the_llm_judges_grades_as_rewards(runs):
  full, _ = runs
  judged = 0
  for node in _dump(full, 1):
    for reward, action in zip(node["rewards"], node["actions"]):
      scores = [
          s["grades"]["judge"]["score"] for s in action["steps"] if "judge" in s.get("grades", {})
      ]
      if scores:
        judged += 1
        assert reward == pytest.approx(sum(scores), abs=1e-6)
        assert 0.0 < reward < 1.0
  assert judged >= 2
  rows = _rows(full)
  assert [r["step"] for r in rows] == [0, 1, 2] and "train/loss" in rows[1]
  assert rows[1]["reward/outcome"] > 0  # the judge's P(PASS) reached the rewards


@pytest.mark.slow
def test_rl_steps_train_on_qwen3_style_thinking_rewrites(runs):
  full, _ = runs
  rows = _rows(full)
  assert sum(r["text/history_rewrites"] for r in rows[1:]) > 0
  rewritten = [
      step
      for node in _dump(full, 1) + _dump(full, 2)
      for action in node["actions"]
      for step in action["steps"]
      if step.get("history_rewrites")
  ]
  assert rewritten and all(step["valid"] for step in rewritten)
  for r in rows[1:]:
    assert np.isfinite(r["train/loss"]) and r["batch/actions"] > 0
    assert 0 < r["train/is_weight_mean"] <= 2.0 and r["train/sampler_gap"] < 1e-3
  assert _rows(full, run_bound=True)[2]["compiles/train_step"] == 2  # update + old logprobs


@pytest.mark.slow
def test_a_killed_run_resumes_exactly_with_the_same_simulated_users(runs):
  full, killed = runs
  assert _rows(killed) == _rows(full)
  assert _dump(killed, 2) == _dump(full, 2)  # the user simulator said the same
