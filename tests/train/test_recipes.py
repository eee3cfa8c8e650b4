"""The recipe API runs the command line's composition root: same metrics, one-line errors."""

import json
import os

import pytest

import mtrl_jax
from configs import calculator as calc_config
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import experiment


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(RUN_BOUND_PREFIXES)}
        for line in f
    ]


def test_the_smoke_run_through_the_recipe_equals_the_command_line(smoke_run, tmp_path, no_curves):
  """The recipe's run of the shared smoke run's config (tests/train/conftest.py, trained
  by `python -m experiments.train`) logs the same metrics."""
  base = calc_config.get_config("smoke=True")
  recipe = mtrl_jax.ENVGRPO(base, checkpoint=dict(keep=smoke_run.config().checkpoint.keep))
  recipe.run(str(tmp_path / "api"))
  api, cli = _metrics(tmp_path / "api"), _metrics(smoke_run.workdir)
  assert len(api) == len(cli) == 4
  for a, c in zip(api, cli):
    assert set(a) == set(c)
    for k in a:
      if k.startswith("compiles/"):
        continue  # the subprocess compiles from scratch, the test process shares a cache
      assert a[k] == pytest.approx(c[k], rel=1e-6, abs=1e-6), k


def test_keyword_fields_and_gspo_defaults():
  r = mtrl_jax.ENVGSPO(
      factory="calculator",
      tasks="calculator",
      model="tiny",
      tree=dict(num_turns=2, num_generations=2),
      seed=3,
  )
  c = r.config
  assert (c.env.factory, c.tasks.source, c.model.preset, c.seed) == (
      "calculator",
      "calculator",
      "tiny",
      3,
  )
  assert c.loss.algorithm == "gspo" and c.loss.clip_eps_high == 4e-4
  assert c.tree.num_generations == 2
  with pytest.raises(experiment.ConfigError, match="recipe field 'tree.num_gens': unknown"):
    mtrl_jax.ENVGRPO(tree=dict(num_gens=2))
  with pytest.raises(experiment.ConfigError, match="loss.algorithm|aggregation"):
    mtrl_jax.ENVGSPO(loss=dict(aggregation="seq-mean-token-sum"))
