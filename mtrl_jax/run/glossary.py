"""The metrics glossary: every key an RL run logs, what it means and its unit.

A run writes one row per step to `workdir/metrics.jsonl` and TensorBoard
(`metrics.MetricsWriter`); the RL loop (`run.rl`) assembles the row from the
tree (`rollout.tree`, `rollout.stats`, `rollout.credit`), the batch
(`rollout.batching`), the train step (`losses.finalize_metrics`, `train.update`,
`train.objectives`), the compile census, timers, the renderer's counters and
held-out evaluations. `SECTIONS` lists each key once, as a pattern where a part
varies: `<a>` an agent index, `<t>` a tree turn, `<mode>` an evaluation pass,
`<name>` any name. `docs/metrics.md` is generated from it
(`python -m experiments.reference`) and tests hold it to the keys a run logs.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

# A pattern's placeholder -> (the regular expression it stands for, what it names).
PLACEHOLDERS = {
    "a": (r"\d+", "an agent index"),
    "t": (r"\d+", "a tree turn"),
    "mode": ("greedy|sampled", "an evaluation pass"),
    "name": (r"[^/]+", "any name"),
}

# (section title, what the section's keys describe, ((pattern, meaning, unit), ...)).
# A table, one row per key as docs/metrics.md shows it: the formatter leaves it alone.
# fmt: off
SECTIONS = (
    ("Rollout", "the step's training rollout: the trees of its `rl.roots_per_step` roots", (
        ("rollout/success", "share of the ended joint actions whose outcome is above "
         "`eval.success_threshold` (a tree lists an early success once, a late one G times "
         "per level)", "fraction"),
        ("rollout/path_success", "chance that one trajectory sampled from a root succeeds "
         "within the tree's turns, mean over roots; comparable with `eval/<mode>/success`",
         "fraction"),
        ("rollout/return", "mean return of a root's valid joint actions, mean over roots",
         "reward"),
        ("rollout/past_first_turn", "share of the episodes (valid joint actions that end a "
         "branch) whose path holds more than one policy turn (a later tree turn or a tool "
         "sub-step); near 0 in a multi-turn tree: the episodes end at the first message",
         "fraction"),
        ("rollout/staleness", "updates between the parameters that sampled the rollout and "
         "the update it feeds (0 on-policy; 1 with `rl.max_staleness=1`)", "updates"),
        ("reward/outcome", "outcome part of the mean joint-action reward: "
         "`reward.outcome_weight` x the final grades' mean score; the four `reward/*` parts "
         "add up to the mean action reward", "reward"),
        ("reward/step_penalty", "step-penalty part: `reward.step_penalty` per environment "
         "step (sub-steps included)", "reward"),
        ("reward/tool_penalty", "tool-penalty part: `reward.tool_penalty` per invalid tool "
         "call or format error", "reward"),
        ("reward/shaping", "shaping part: `reward.shaping_weight` x the per-turn grades' mean "
         "score", "reward"),
        ("turn_<t>/mean_reward", "mean reward of the valid joint actions at tree turn t",
         "reward"),
        ("turn_<t>/mean_return", "mean return of the valid joint actions at tree turn t",
         "reward"),
    )),
    ("Agents", "several agents (`tree.num_agents` > 1), over the valid joint actions", (
        ("agent_<a>/reward/team", "mean team (joint) reward; the same for every agent",
         "reward"),
        ("agent_<a>/reward/local", "mean local reward of agent a (its own grade, "
         "`Grade.agent_scores`; the team reward where it had none)", "reward"),
        ("agent_<a>/reward/total", "mean reward agent a trains on: `agents.team_weight` x "
         "team + (1 - team_weight) x local", "reward"),
        ("agent_<a>/reward/local_graded", "share of the joint actions that graded agent a "
         "alone", "fraction"),
        ("agent_<a>/influence", "`cross` and `marginal` joint modes: share of the variance of "
         "a node's joint rewards explained by agent a's choice of sample, mean over the nodes "
         "whose rewards varied (absent where none did)", "fraction"),
        ("credit/varied_nodes", "`cross` and `marginal` joint modes: share of the nodes "
         "with a valid joint action whose joint rewards varied (the nodes influence averages)",
         "fraction"),
        ("agent_<a>/batch/actions", "separate policies: agent a's actions in the train batch",
         "count"),
        ("agent_<a>/batch/tokens_trained", "separate policies: tokens in agent a's rows",
         "tokens"),
        ("agent_<a>/train/<name>", "separate policies: agent a's own `train/<name>` (a "
         "frozen agent has none; `train/<name>` is then the mean over the trained agents)",
         "as train/<name>"),
    )),
    ("Tree", "the shape of the step's trees", (
        ("tree/nodes", "nodes of the step's trees", "count"),
        ("tree/terminated", "nodes made leaves by early termination (mean sibling reward "
         "above `tree.termination_threshold`)", "count"),
        ("tree/masked_actions", "joint actions masked out of training (contract, "
         "infrastructure or timeout faults)", "count"),
        ("tree/substeps", "continuation segments sampled within actions "
         "(`tree.branch_on='user_turn'`: a tool result answered in the same turn)", "count"),
        ("tree/sampled_tokens", "tokens the policy sampled in the step's rollout (context "
         "excluded)", "tokens"),
        ("tree/cut_episodes", "valid joint actions whose episode the environment would have "
         "continued past the last turn (graded by `Environment.on_cut`)", "count"),
        ("tree/cut_fraction", "cut episodes / every episode end (valid joint actions without "
         "a child)", "fraction"),
    )),
    ("Faults", "faults over every step of every joint action (masked ones included), by "
     "kind (`envs.faults`); a kind absent from a row had none", (
        ("faults/model_format", "the policy's text could not be parsed (malformed tool "
         "call, no answer); may be penalised", "count"),
        ("faults/tool_error", "a well-formed tool call the tool rejected; may be penalised",
         "count"),
        ("faults/contract", "environment, tool or grader code broke the API; the sample is "
         "masked", "count"),
        ("faults/infrastructure", "a service, connection or disk failed; retried, then "
         "masked", "count"),
        ("faults/timeout", "a tool or environment call ran past its limit; masked (or told "
         "to the policy with `env.tool_timeout='tell'`)", "count"),
        ("faults/truncation", "the framework stopped a trajectory at its turn cap or token "
         "budget", "count"),
    )),
    ("Tools", "the policy's tool use, over the steps of environments that offer tools (a "
     "non-empty `ToolSet`; `rollout.stats.tool_metrics`); a run whose environment offers none "
     "logs no `tools/*` key", (
        ("tools/turns_with_call", "share of the policy's turns (sub-steps and masked actions "
         "included) the environment answered with at least one tool turn", "fraction"),
        ("tools/calls", "tool calls: one tool turn each (a malformed message's error turn "
         "counts as one)", "count"),
        ("tools/valid_calls", "calls without a fault from the tool set (parse failure, "
         "rejected call, failed or timed-out tool); 0 for several steps warns", "count"),
        ("tools/parse_failures_per_call", "malformed tool-call messages (`model_format` "
         "faults of the tool set) per call; 0 without calls", "fraction"),
        ("tools/calls_per_episode", "tool calls along an episode's path from its root, mean "
         "over the episodes", "calls"),
    )),
    ("Batch", "the train batch built from the tree (`rollout.batching`)", (
        ("batch/actions", "sampled actions in the train batch", "count"),
        ("batch/zero_variance_groups", "sibling groups whose advantages were all 0, dropped "
         "by `rl.zero_variance_filter`", "count"),
        ("batch/rows", "rows of the batch (a bucket, padding rows included)", "rows"),
        ("batch/length", "row length (an `rl.length_buckets` entry)", "tokens"),
        ("batch/tokens_trained", "tokens in the batch's rows, context included (tree "
         "packing holds each shared prefix once)", "tokens"),
        ("batch/tokens_rows_equivalent", "tokens one row per action would hold "
         "(`rl.packing='rows'`): over `batch/tokens_trained`, what tree packing saves",
         "tokens"),
        ("batch/padding_fraction", "share of the batch's token slots that are padding",
         "fraction"),
    )),
    ("Train", "the policy update (the step's last one with `rl.updates_per_step` > 1); per "
     "token means are over the trained (policy) tokens", (
        ("train/loss", "the loss minimised (policy term, KL penalty, value term)", "loss"),
        ("train/pg_loss", "the policy-gradient term alone, same aggregation", "loss"),
        ("train/kl", "KL to the reference per token (`loss.kl_estimator`); with "
         "`loss.kl_coef` > 0", "nats"),
        ("train/kl_k3", "the k3 KL estimate per token; with `loss.kl_coef` > 0", "nats"),
        ("train/entropy", "policy entropy per token", "nats"),
        ("train/tokens", "trained tokens", "tokens"),
        ("train/rows", "sequences (actions) with a trained token", "count"),
        ("train/clip_frac", "share of tokens whose surrogate was clipped", "fraction"),
        ("train/clip_frac_high", "share clipped at 1 + `loss.clip_eps_high`", "fraction"),
        ("train/clip_frac_low", "share clipped at 1 - `loss.clip_eps_low`", "fraction"),
        ("train/ratio_mean", "mean ratio pi / pi_old the surrogate uses (GSPO: the "
         "sequence's)", "ratio"),
        ("train/ratio_min", "smallest such ratio", "ratio"),
        ("train/ratio_max", "largest such ratio", "ratio"),
        ("train/logp_gap", "mean abs(logp - old_logp) per token: sampler vs trainer",
         "nats"),
        ("train/logp_gap_max", "largest abs(logp - old_logp)", "nats"),
        ("train/adv_mean", "mean advantage (per action, or per token for token "
         "advantages)", "advantage"),
        ("train/adv_std", "standard deviation of the advantages", "advantage"),
        ("train/adv_min", "smallest advantage", "advantage"),
        ("train/adv_max", "largest advantage", "advantage"),
        ("train/is_weight_mean", "`loss.is_correction`: mean importance weight per token",
         "ratio"),
        ("train/is_truncated", "'tis': tokens whose ratio was above `loss.is_cap`",
         "tokens"),
        ("train/is_truncated_frac", "'tis': their share", "fraction"),
        ("train/is_masked", "'mis_token' / 'mis_action': tokens dropped", "tokens"),
        ("train/is_masked_frac", "their share", "fraction"),
        ("train/is_ratio_min", "smallest sampler ratio pi_old / pi_sampler", "ratio"),
        ("train/is_ratio_max", "largest sampler ratio", "ratio"),
        ("train/sampler_gap", "mean abs(old_logp - sampler_logp) per token", "nats"),
        ("train/grad_norm", "global norm of the gradient", "norm"),
        ("train/learning_rate", "the schedule's rate at this update", "rate"),
        ("train/skipped", "1 when the update was skipped: non-finite loss or gradient "
         "(`step.nonfinite`)", "0 or 1"),
        ("train/num_skipped", "updates skipped so far in the run", "updates"),
        ("train/empty_batch", "1 when the batch had no trained token (nothing changed)",
         "0 or 1"),
        ("train/step", "optimizer updates applied before this one", "updates"),
        ("train/value_loss", "a critic (`critic.kind`): mean (clipped) squared error / 2 of "
         "the values against their targets", "reward^2"),
        ("train/value_mean", "mean predicted value", "reward"),
        ("train/value_target_mean", "mean value target", "reward"),
        ("train/value_explained_var", "1 - MSE / Var(target) (0 when the targets are "
         "constant)", "fraction"),
        ("train/value_slots", "actions whose value was trained", "count"),
        ("critic/<name>", "a critic model of its own: its update's metrics, named as their "
         "`train/<name>` namesakes", "as train/<name>"),
        ("sft_mix/nll", "`sft.mix_every`: the SFT step's negative log-likelihood per token",
         "nats"),
        ("sft_mix/grad_norm", "its gradient norm", "norm"),
        ("sft_mix/tokens", "its trained tokens", "tokens"),
    )),
    ("Evaluation", "held-out evaluation of the first `eval.num_tasks` eval tasks, one path "
     "per task, at step 0, every `eval.every` steps and the last; `<mode>`: greedy "
     "(`eval.greedy`) or sampled at temperature 1 (`eval.sampled`)", (
        ("eval/<mode>/success", "share of tasks whose path ended with an outcome above "
         "`eval.success_threshold`", "fraction"),
        ("eval/<mode>/outcome", "mean outcome of the path's last action", "reward"),
        ("eval/<mode>/return", "mean sum of the path's rewards", "reward"),
        ("eval/<mode>/turns", "mean tree turns per path", "turns"),
        ("eval/<mode>/masked", "share of paths whose last action was masked", "fraction"),
        ("eval/<mode>/cut_fraction", "share of paths the tree cut at its last turn",
         "fraction"),
        ("eval/<mode>/agent_<a>/local", "several agents: agent a's mean local reward (its "
         "own grade) of the ending joint action, over paths whose ending action graded it "
         "alone", "reward"),
        ("curriculum/level", "`curriculum.enabled`: the level the step's tasks came from",
         "level"),
        ("curriculum/rolling_success", "mean `rollout/success` over the window so far",
         "fraction"),
    )),
    ("Text", "the renderer's token-in, token-out checks (docs/design.md invariant 1), in "
     "the step's rollout and evaluation", (
        ("text/completions_checked", "sampled completions whose re-tokenisation was "
         "checked", "count"),
        ("text/retokenize_mismatches", "completions whose text re-encodes to other ids",
         "count"),
        ("text/retokenize_mismatch_rate", "mismatches / completions checked", "fraction"),
        ("text/history_rewrites", "contexts that did not extend the tokens before them (a "
         "template rewrote history): a new segment", "count"),
    )),
    ("Schedule", "depend on the machine and the schedule, not only the seed "
     "(`metrics.RUN_BOUND_PREFIXES`)", (
        ("engine/slot_occupancy", "decoding slots / all slots, mean over decode chunks "
         "(with `engine.overlap` a finished row counts until its chunk is read, one chunk "
         "later)", "fraction"),
        ("engine/slot_parked", "parked slots (caches kept for a continuation) / all slots, "
         "mean over decode chunks", "fraction"),
        ("engine/decode_chunks", "decode chunks run (one device call each, every slot "
         "stepping)", "count"),
        ("engine/prefill_tokens", "prompt tokens prefilled (only new ones where a cache was "
         "reused)", "tokens"),
        ("engine/decode_tokens", "tokens sampled", "tokens"),
        ("engine/kv_reuse", "share of the requests' context tokens served from a cache",
         "fraction"),
        ("engine/decode_efficiency", "sampled tokens / decoded slot-steps", "fraction"),
        ("engine/evictions", "parked caches dropped for lack of slots", "count"),
        ("time/step", "the whole step", "s"),
        ("time/rollout", "the step's rollout section (running or awaiting it)", "s"),
        ("time/rollout_wait", "the loop waiting for the step's rollout", "s"),
        ("time/train", "the update(s) and any SFT mix step", "s"),
        ("time/eval", "held-out evaluation (steps with one)", "s"),
        ("time/first_step", "from the start of training to the end of the first update "
         "(compiles included); the first step after a start or resume", "s"),
        ("time/generation", "rollout time in engine steps (admission and decode)", "s"),
        ("time/environment", "rollout time with an environment step in flight", "s"),
        ("time/overlap", "engine steps while environment steps were in flight", "s"),
        ("time/device_idle", "the engine had nothing to run, waiting for environments",
         "s"),
        ("time/env_waiting", "engine steps while no environment step was in flight", "s"),
        ("compiles/engine", "programs the rollout engine compiled", "count"),
        ("compiles/train_step", "programs the train step compiled", "count"),
        ("compiles/sft_step", "programs the SFT warm-up compiled", "count"),
        ("compiles/sft_mix_step", "programs the SFT mix step compiled", "count"),
        ("compiles/backend_total", "XLA compilations in the process since the run began, "
         "eager ops included", "count"),
        ("compiles/after_warmup", "compilations after warm-up (docs/design.md invariant 5: "
         "stays 0)", "count"),
        ("compiles/<name>", "programs another registered jitted function compiled",
         "count"),
    )),
    ("Row", "", (
        ("step", "the row's RL step (0: the evaluation before the first update)", "step"),
    )),
)
# fmt: on

METRICS = {p: (meaning, unit) for _, _, rows in SECTIONS for p, meaning, unit in rows}


def pattern_regex(pattern: str) -> re.Pattern:
  """The regular expression of a key pattern: each `<x>` stands for `PLACEHOLDERS[x]`'s."""
  parts = re.split(r"<(\w+)>", pattern)
  body = "".join(
      re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p][0]})" for i, p in enumerate(parts)
  )
  return re.compile(body + r"\Z")


_REGEXES = [(p, pattern_regex(p)) for p in METRICS]


def entry_of(key: str) -> Optional[str]:
  """The first pattern of `METRICS` that `key` matches, or None."""
  return next((p for p, rx in _REGEXES if rx.match(key)), None)


def unknown_keys(keys: Iterable[str]) -> list[str]:
  """The keys no pattern of `METRICS` matches, sorted."""
  return sorted({k for k in keys if entry_of(k) is None})
