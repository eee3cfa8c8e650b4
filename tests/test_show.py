"""experiments/show.py prints whole episodes of a rollout dump, and refuses a run without one."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import show
from mtrl_jax.envs.reward import RewardConfig
from mtrl_jax.rollout import TreeConfig, expand_tree, write_rollout_dump
from mtrl_jax.rollout.dump import dump_files, dump_path, read_dump
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.testing import FakePolicy, ToolThenUserEnv, byte_renderer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOOL = re.compile(r"<\|tool\|>(\d+)<\|end\|><\|assistant\|>$")


class ToolReader(FakePolicy):
  """Sample g of a turn writes g + 1 letters; after the tool's reply (their count) it
  repeats the count, except for 2 (so sample 1's turns score 0)."""

  def __init__(self, renderer):
    super().__init__()
    self.renderer = renderer

  def completion(self, req, g):
    m = _TOOL.search(self.renderer.tokenizer.decode(list(req.prompt)))
    if m:
      text = f"the tool said {m.group(1) if m.group(1) != '2' else 0}"
    else:
      text = "ab"[g] * (g + 1)
    ids = self.renderer.tokenizer.encode(text) + [self.renderer.fmt.stop_ids[0]]
    return np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), "stop"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A workdir with one dump of step 7: two roots, T = 2 user turns x G = 2, each turn a
  tool call and its reading (ToolThenUserEnv, graded per turn)."""
  workdir = str(tmp_path_factory.mktemp("shown"))
  renderer = byte_renderer()
  transition = EnvTransition(renderer, reward_cfg=RewardConfig(shaping_weight=1.0))
  roots = [
      transition.root_state(ToolThenUserEnv({"prompt": p}))
      for p in ("count my letters", "and mine")
  ]
  tree = expand_tree(
      TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn"),
      ToolReader(renderer),
      transition,
      roots,
      jax.random.key(0),
  )
  write_rollout_dump(tree, dump_path(workdir, 7), renderer.tokenizer.decode)
  return workdir


def test_every_episode_is_printed_whole_with_its_rewards(run_dir):
  nodes = read_dump(dump_files(run_dir)[7])
  paths = show.episodes(nodes)
  assert len(paths) == 8 and all(len(p) == 2 for p in paths)  # 2 roots x 2 x 2
  text = show.show(run_dir, episodes_wanted=8)
  assert text.count("=== episode ") == 8 and "step 7" in text
  assert "count my letters" in text and "and mine" in text  # the roots' prompts
  assert "<|user|>next<|end|>" in text  # the context a child turn adds
  for node in nodes:  # every completion, tool turn, reward, return and advantage
    for completion in node["completions"][0]:
      for segment in re.split(r"<\|tool\|>\d+<\|end\|><\|assistant\|>", completion):
        assert segment in text, segment
    for b, reward in enumerate(node["rewards"]):
      assert f"reward {reward:.3f}" in text and f"return {node['returns'][b]:.3f}" in text
    assert f"advantage agent 0: {node['advantages'][0][1]:.3f}" in text
  assert "the tool said 1" in text and "the tool said 0" in text
  assert "reward 1.000" in text and "reward 0.000" in text and "advantage agent 0: -0.500" in text
  assert "[tool / context]" in text and "<|tool|>2<|end|>" in text
  assert "end: cut at the tree's last turn" in text  # the environment never stops


def test_episodes_are_a_seeded_sample_of_the_step(run_dir):
  one = show.show(run_dir, episodes_wanted=3, seed=1)
  assert one == show.show(run_dir, episodes_wanted=3, seed=1) and one.count("=== episode ") == 3
  with pytest.raises(ValueError, match=r"--step=3: .* has no dump of it; allowed: \[7\]"):
    show.show(run_dir, 1, step=3)


def test_the_command_prints_episodes_or_one_line_naming_rl_dump_every(run_dir, tmp_path):
  cmd = [sys.executable, "-m", "experiments.show", "--episodes=1"]
  out = subprocess.run(
      cmd + [f"--workdir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.count("=== episode 1 of 1 ") == 1 and "completion (agent 0" in out.stdout
  (tmp_path / "config.json").write_text(json.dumps({"rl": {"dump_every": 0}}))
  out = subprocess.run(
      cmd + [f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 2 and not out.stdout
  err = out.stderr.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and "has no rollout dumps" in err[0]
  assert "rl.dump_every steps" in err[0] and "(this run: rl.dump_every=0)" in err[0]
