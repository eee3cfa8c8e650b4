"""experiments/eval.py and experiments/export.py on a tiny finished run (calculator smoke)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import calculator as calc_config
from mtrl_jax import testing, text
from mtrl_jax.run import components, experiment, saved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL_KEYS = ("success", "outcome", "return", "turns", "masked")


@pytest.fixture
def run_dir(smoke_run):
  """The shared finished 3-step run (tests/train/conftest.py): checkpoints at steps 0-3,
  best kept at its held-out evals. Read only."""
  return smoke_run.workdir


def _entry(script, *flags):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", script), *flags],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_config_json_rebuilds_the_same_experiment(smoke_run):
  assert experiment.validate(saved.load_config(smoke_run.workdir)) == experiment.validate(
      smoke_run.config()
  )


def test_config_json_saved_before_a_field_existed_loads_with_its_default(tmp_path):
  c = calc_config.get_config("smoke=True")
  c.model.num_layers = 3  # the preset's depth overridden
  saved.save_config(c, str(tmp_path))
  older = json.loads((tmp_path / "config.json").read_text())
  del older["model"]["num_layers"], older["curriculum"]  # written before these existed
  (tmp_path / "config.json").write_text(json.dumps(older))
  loaded = saved.load_config(str(tmp_path))
  assert loaded.model.num_layers == 0 and not loaded.curriculum.enabled
  c.model.num_layers = 0
  assert experiment.validate(loaded) == experiment.validate(c)
  c.model.num_layers = 3
  assert experiment.validate(c).model.num_layers == 3


def test_eval_reproduces_the_runs_final_evaluation(run_dir, tmp_path):
  out = _entry(
      "eval.py",
      f"--workdir={run_dir}",
      "--checkpoint=latest",
      "--samples=3",
      f"--json={tmp_path / 'rows.json'}",
  )
  assert out.returncode == 0, out.stderr
  rows = json.loads((tmp_path / "rows.json").read_text())
  final = _rows(run_dir)[-1]
  assert final["step"] == 3
  greedy, sampled = rows
  assert (greedy["mode"], greedy["checkpoint"], greedy["tasks"]) == ("greedy", "latest (step 3)", 4)
  # The same policy, tasks and greedy rollout as the run's own held-out eval at step 3.
  assert {k: greedy[k] for k in EVAL_KEYS} == pytest.approx(
      {k: final[f"eval/greedy/{k}"] for k in EVAL_KEYS}, abs=1e-9
  )
  assert (sampled["mode"], sampled["attempts"]) == ("sampled", 3)
  assert sampled["success"] <= sampled["pass@3"] <= min(1.0, 3 * sampled["success"])
  table = out.stdout.strip().splitlines()
  assert table[0].startswith("| checkpoint | mode |") and "pass@3" in table[0]
  assert len(table) == 4 and table[2].startswith("| latest (step 3) | greedy | 4 | 1 |")


@pytest.mark.slow
def test_eval_and_export_refuse_bad_checkpoints_in_one_line(run_dir, tmp_path):
  (tmp_path / "fresh").mkdir()  # a run that wrote its config and died before a checkpoint
  (tmp_path / "fresh" / "config.json").write_text(
      (open(os.path.join(run_dir, "config.json")).read())
  )
  for script, flags, needle in (
      ("eval.py", [f"--workdir={run_dir}", "--checkpoint=7"], "--checkpoint=7"),
      ("eval.py", [f"--workdir={run_dir}", "--checkpoint=newest"], "--checkpoint='newest'"),
      (
          "export.py",
          [f"--workdir={tmp_path / 'none'}", f"--out={tmp_path / 'hf'}"],
          "has no config.json",
      ),
      (
          "export.py",
          [f"--workdir={tmp_path / 'fresh'}", f"--out={tmp_path / 'hf'}"],
          "has no checkpoints",
      ),
  ):
    out = _entry(script, *flags)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert needle in [l for l in out.stderr.splitlines() if l.strip()][-1], out.stderr
  assert not (tmp_path / "hf").exists()
  assert os.listdir(tmp_path / "fresh") == ["config.json"]  # nothing created there


def test_export_loads_in_transformers_with_equal_logits(run_dir, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out_dir = tmp_path / "hf"
  out = _entry("export.py", f"--workdir={run_dir}", f"--out={out_dir}")
  assert out.returncode == 0, out.stderr
  assert "byte-level tokenizer" in out.stdout and "no tokenizer.json" in out.stdout
  files = set(os.listdir(out_dir))
  assert {"config.json", "model.safetensors", saved.BYTE_TOKENIZER_FILE} <= files
  assert "tokenizer.json" not in files

  policy = saved.load_policy(run_dir, "best")
  # The best checkpoint's parameters are those of the step it was kept at.
  at_step = saved.load_policy(run_dir, policy.step)
  for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(at_step.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(out_dir), attn_implementation="eager"
  ).eval()
  tokens = np.random.RandomState(0).randint(0, policy.exp.model.arch.vocab_size, (3, 12))
  ours = testing.logits(policy.model, tokens)
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

  hf_cfg = json.loads((out_dir / "config.json").read_text())
  assert (hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (
      policy.tokenizer.eos_id,
      policy.tokenizer.pad_id,
  )
  # The byte tokenizer's description rebuilds the run's tokenizer exactly.
  desc = json.loads((out_dir / saved.BYTE_TOKENIZER_FILE).read_text())
  rebuilt = text.ByteTokenizer(specials=desc["special_tokens"])
  sample = "<answer>12</answer> héllo"
  assert rebuilt.encode(sample) == policy.tokenizer.encode(sample)
  assert rebuilt.vocab_size == desc["vocab_size"] == hf_cfg["vocab_size"]


def test_export_of_an_hf_tokenizer_run_copies_its_tokenizer(tmp_path):
  transformers = pytest.importorskip("transformers")
  src = tmp_path / "base"
  testing.hf_checkpoint(str(src))
  c = calc_config.get_config("smoke=True")
  c.model.path, c.tokenizer.kind, c.tokenizer.chat_format = str(src), "hf", "chatml"
  c.tokenizer.extra_specials, c.sft.steps = "", 0
  exp = experiment.validate(c)
  policy = saved.SavedPolicy(str(tmp_path), components.build(exp), step=0, checkpoint="latest")
  tok = policy.tokenizer
  info = saved.export_policy(policy, str(tmp_path / "hf"))
  assert info["tokenizer"] == ["tokenizer.json", "tokenizer_config.json"]
  for name in info["tokenizer"]:
    assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes()
  hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert (hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (tok.eos_id, tok.pad_id)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  sample = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>"
  assert theirs(sample)["input_ids"] == tok.encode(sample)


def test_a_policy_as_built_samples_every_agents_starting_weights(tmp_path):
  """No checkpoint restored: the engine samples each agent's own starting weights, stacked
  on the agent axis as a restored checkpoint's would be."""
  from configs import coop as coop_config
  from mtrl_jax.rollout.policy import StackedStates

  c = coop_config.get_config("smoke=True")
  c.sft.steps = 0
  parts = components.build(experiment.validate(c))
  policy = saved.SavedPolicy(str(tmp_path), parts, step=0, checkpoint="latest")
  states = policy.params
  assert isinstance(states, StackedStates) and states.num_agents == 2
  starts = [nnx.state(m, nnx.Param) for m in parts.policies.models]
  for a, start in enumerate(starts):
    got = jax.tree.map(lambda x, a=a: np.asarray(x[a]), states.params)
    jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, start))
  for model, start in zip(policy.models(), starts):
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), start)
