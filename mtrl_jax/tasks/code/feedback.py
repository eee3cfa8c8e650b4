"""External transitions of the code task: turn t+1 prompts from turn t responses.

`build_transition` reproduces the reference's external modes
(docs/comlrl.md section 1.4). Each agent's prompt is, in order: its full
history (`History: previous prompts:` with every prompt it saw, then its own
previous responses; agents never see each other's transcript), a mode block,
and a closing instruction. Modes:

  level_feedback  (default) static + execution diagnostics of the joint action:
                  definitions, syntax, sandbox test results with one line per
                  failing assert; the main agent also gets aux-usage lines.
  level_passed    compact signals (implementation, syntax, tests, aux usage).
  passed          one line: all levels passed or not.
  plain           no diagnostics: history + a revise instruction.
  expert_edits    edits proposed by an expert model (any `expert(prompt) ->
                  str` callable answering JSON {"aux": ..., "main": ...}),
                  3 tries, empty edits when all fail.
  bandit          no transition: every turn re-sends the turn-1 prompts.

`revision_blocks` gives the text after the history alone (the mode block and
the closing instruction), for chat-native environments whose threads already
hold each agent's history.

Diagnostics run the combined code (prompt imports + aux + main) against the
*sandbox* tests: `sandbox_slice` asserts of the task's tests (1: the first;
n > 0 the first n; n < 0 the last |n|; 0, None or 'all': all), in the sandbox,
per assert with a 10 s alarm, stopping after 3 timeouts, and only when the
syntax is OK. Rewards always use all tests; only the feedback is sliced.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from mtrl_jax.envs import sandbox
from mtrl_jax.tasks.code import analysis
from mtrl_jax.tasks.code.expert import ExpertModel, request_expert_edits

MODES = ("level_feedback", "level_passed", "passed", "plain", "expert_edits", "bandit")
_ALIASES = {
    "feedback": "level_feedback",
    "signals": "level_passed",
    "expert": "expert_edits",
    "edits": "expert_edits",
}


def parse_sandbox_slice(value) -> int | None:
  """Normalises `external.sandbox_slice`: int n, 'all' -> 0, '3' -> 3, None -> None.

  0 and None both mean "all asserts". Raises ValueError for anything else
  (the reference silently fell back to all tests on unparsable strings).
  """
  if value is None or (isinstance(value, int) and not isinstance(value, bool)):
    return value
  if isinstance(value, str):
    text = value.strip().lower()
    if text == "all":
      return 0
    if re.fullmatch(r"-?\d+", text):
      return int(text)
  raise ValueError(f"sandbox_slice must be an int, 'all', a numeric string or None; got {value!r}")


def slice_tests(test_code: str, n: int | None) -> str:
  """Keeps the preamble, `def check(candidate):` and the first n (last |n|) asserts."""
  if not isinstance(test_code, str) or not test_code.strip() or not n:
    return test_code
  lines = test_code.splitlines()
  check = next(
      (i for i, l in enumerate(lines) if re.match(r"\s*def\s+check\s*\(candidate\)\s*:\s*", l)),
      None,
  )
  preamble = lines if check is None else lines[:check]
  asserts = [
      l.strip()
      for l in lines[(check + 1 if check is not None else 0) :]
      if l.strip().startswith("assert") and "candidate" in l
  ]
  if not asserts:
    return test_code
  parts = ["\n".join(preamble).strip()] if "\n".join(preamble).strip() else []
  parts.append("def check(candidate):")
  parts += [f"    {a}" for a in (asserts[:n] if n > 0 else asserts[n:])]
  return "\n".join(parts) + "\n"


@dataclasses.dataclass(frozen=True)
class Diagnostics:
  """What the feedback modes say about one joint action."""

  aux_func: str
  main_func: str
  aux_defined: bool
  aux_message: str
  main_defined: bool
  main_message: str
  syntax_ok: bool
  syntax_message: str
  syntax_error: dict | None
  aux_called: bool
  aux_misuse: tuple[str, ...]
  is_wrapper: bool
  tests_passed: int
  tests_total: int
  failures: tuple[sandbox.AssertResult, ...]  # executed asserts that did not pass


def analyze(
    task: Mapping[str, str],
    aux: str,
    main: str,
    num_agents: int,
    test_code: str,
    *,
    timeout_per_assert_s: float = 10.0,
    max_timeouts: int = 3,
) -> Diagnostics:
  """Static checks of (aux, main) and, if the syntax is OK, a sandbox test run."""
  ep = task["entry_point"]
  main_func = analysis.extract_function(main, ep)
  main_ok, main_msg = analysis.check_function_definition(main, ep, f"Main function ({ep})")
  if num_agents == 1:
    aux_func, aux_ok, aux_msg = "", False, "Single-agent mode: aux not used"
  else:
    aux_func = analysis.extract_function(aux, "aux")
    aux_ok, aux_msg = analysis.check_function_definition(aux, "aux", "Aux function")
  code = analysis.combine_code(aux_func, main_func, analysis.extract_imports(task["prompt"]))
  syntax_ok, syntax_msg, syntax_error = analysis.check_syntax(code, "Combined code")
  multi = num_agents > 1 and bool(main_func)
  passed, total, failures = 0, 0, ()
  cases = analysis.extract_test_cases(test_code, ep) if syntax_ok and test_code and ep else []
  if cases:
    results = sandbox.run_tests(
        code, cases, timeout_per_assert_s, max_timeouts, prelude="import math"
    )
    passed, total = sum(r.passed for r in results), len(cases)
    failures = tuple(r for r in results if r.status not in ("passed", "skipped"))
  return Diagnostics(
      aux_func,
      main_func,
      aux_ok,
      aux_msg,
      main_ok,
      main_msg,
      syntax_ok,
      syntax_msg,
      syntax_error,
      multi and analysis.calls_aux(main_func),
      tuple(analysis.misused_aux_calls(main_func)) if multi else (),
      multi and analysis.is_thin_wrapper(main_func),
      passed,
      total,
      failures,
  )


def _history(prompts: Sequence[str], responses: Sequence[str], label: str) -> list[str]:
  lines = []
  if prompts:
    lines.append("History: previous prompts:")
    lines += [f"- Turn {t} prompt:\n{p}" for t, p in enumerate(prompts, 1)]
    lines.append("")
  if responses:
    lines.append(f"History: {label}:")
    lines += [f"- Turn {t} response:\n{r}" for t, r in enumerate(responses, 1)]
    lines.append("")
  return lines


def _found(ok: bool) -> str:
  return "FOUND" if ok else "MISSING"


def _level_feedback(d: Diagnostics, role: str, num_agents: int) -> list[str]:
  aux_line = f"- Aux definition: {_found(d.aux_defined)} ({d.aux_message})"
  main_line = f"- Main definition: {_found(d.main_defined)} ({d.main_message})"
  lines = ["Static and execution diagnostics:"]
  if num_agents == 1:
    lines.append(main_line)
  else:
    lines += [aux_line, main_line] if role == "aux" else [main_line, aux_line]
  lines.append(f"- Syntax: {'OK' if d.syntax_ok else 'ERROR'} ({d.syntax_message})")
  if d.syntax_error:
    se = d.syntax_error
    lines.append(f"  SyntaxError at line {se['line']}, col {se['offset']}: {se['msg']}")
  if d.tests_total > 0:
    lines.append(f"- Tests: {d.tests_passed}/{d.tests_total} passed")
    lines += [
        f"  Failed case: {f.assertion} -> {f.error_type}: {f.error_message}" for f in d.failures
    ]
  else:
    lines.append("- Tests: no test cases found")
  if role == "main" and num_agents > 1 and d.main_defined:
    if not d.aux_called:
      lines.append("- Aux usage: main does NOT call aux")
    elif d.aux_misuse:
      lines.append(f"- Aux usage: called but misused ({', '.join(d.aux_misuse[:2])})")
    else:
      lines.append("- Aux usage: main calls aux and uses its result")
    if d.is_wrapper:
      lines.append("- Warning: main appears to be a thin wrapper over aux")
  return lines


def _signals(d: Diagnostics, role: str, num_agents: int) -> list[str]:
  if d.tests_total == 0:
    tests = "No tests found"
  elif d.tests_passed == d.tests_total:
    tests = "Passed all tests"
  elif d.tests_passed == 0:
    tests = "No tests passed"
  else:
    tests = f"Passed {d.tests_passed}/{d.tests_total} tests"
  ok = d.aux_defined if role == "aux" else d.main_defined
  lines = [
      "Signals:",
      f"- Implementation: {'OK' if ok else 'No implementation found in required structure'}",
      f"- Syntax: {'Syntax correct' if d.syntax_ok else 'Syntax not correct'}",
      f"- Tests: {tests}",
  ]
  if role == "main" and num_agents > 1:
    if not d.main_defined:
      usage = "Main missing; cannot check aux usage"
    elif not d.aux_called:
      usage = "Main does not call aux"
    elif d.aux_misuse:
      usage = "Aux called but result not used properly"
    else:
      usage = "Aux call present and used"
    lines.append(f"- Aux usage: {usage}")
  return lines + [""]


def _passed(d: Diagnostics) -> list[str]:
  ok = d.syntax_ok and d.main_defined and d.tests_total > 0 and d.tests_passed == d.tests_total
  return [f"Signal: {'All levels passed' if ok else 'Not all levels passed'}", ""]


def _check_args(mode, task, completions, prompt_hist, response_hist, num_agents, expert):
  mode = _ALIASES.get(str(mode).lower(), str(mode).lower())
  if mode not in MODES:
    raise ValueError(f"external mode {mode!r} is not one of {MODES}")
  if num_agents not in (1, 2):
    raise ValueError(f"num_agents must be 1 or 2 for the code task, got {num_agents!r}")
  for name, value in (
      ("agent_completions", completions),
      ("prompt_history_per_agent", prompt_hist),
      ("response_history_per_agent", response_hist),
  ):
    if len(value) != num_agents:
      raise ValueError(f"{name} must hold one entry per agent ({num_agents}), got {len(value)}")
  missing = [k for k in ("prompt", "test", "entry_point") if k not in task]
  if missing:
    raise ValueError(f"task lacks the fields {missing}; needs prompt, test, entry_point")
  if mode == "bandit" and not all(prompt_hist):
    raise ValueError(
        "external mode 'bandit' needs each agent's turn-1 prompt in prompt_history_per_agent"
    )
  if mode == "expert_edits" and expert is None:
    raise ValueError("external mode 'expert_edits' needs an expert model (expert=...)")
  return mode


def _mode_blocks(
    mode: str,
    task: Mapping[str, str],
    agent_completions: Sequence[str],
    num_agents: int,
    sandbox_slice,
    expert: ExpertModel | None,
    timeout_per_assert_s: float,
    max_timeouts: int,
) -> list[list[str]]:
  """Per agent, the lines that follow its history: mode block + closing instruction."""
  ep = task["entry_point"]
  roles = ["main"] if num_agents == 1 else ["aux", "main"]
  aux, main = ("", agent_completions[0]) if num_agents == 1 else tuple(agent_completions)
  diagnostics = edits = None
  if mode in ("level_feedback", "level_passed", "passed"):
    n = parse_sandbox_slice(sandbox_slice)
    tests = task["test"] if n in (None, 0) else slice_tests(task["test"], n)
    diagnostics = analyze(
        task,
        aux,
        main,
        num_agents,
        tests,
        timeout_per_assert_s=timeout_per_assert_s,
        max_timeouts=max_timeouts,
    )
  elif mode == "expert_edits":
    edits = dict(zip(("aux", "main"), request_expert_edits(expert, task, aux, main, num_agents)))
  blocks = []
  for role in roles:
    target = "aux" if role == "aux" else (ep or "main")
    if mode == "level_feedback":
      lines = _level_feedback(diagnostics, role, num_agents)
      lines.append(
          f"\nRevise your {target}(...) accordingly. "
          "Output ONLY the function code with no extra text."
      )
    elif mode == "level_passed":
      lines = _signals(diagnostics, role, num_agents)
      lines.append(f"Revise your {target}(...) accordingly. Output ONLY the function code.")
    elif mode == "passed":
      lines = _passed(diagnostics)
      lines.append(f"Revise your {target}(...) if needed. Output ONLY the function code.")
    elif mode == "plain":
      lines = [f"Revise your {target}(...) accordingly. Output ONLY the function code."]
    else:
      header = (
          "Here is an edited snippet from an expert model:"
          if num_agents == 1
          else "Here is edited snippet from an expert model:"
      )
      lines = [
          header,
          (edits[role] or "").strip(),
          "",
          f"Revise your {target}(...) accordingly. "
          "Output ONLY the function code with no extra text.",
      ]
    blocks.append(lines)
  return blocks


def build_transition(
    mode: str,
    task: Mapping[str, str],
    agent_completions: Sequence[str],
    prompt_history_per_agent: Sequence[Sequence[str]],
    response_history_per_agent: Sequence[Sequence[str]],
    num_agents: int = 2,
    sandbox_slice: int | str | None = 1,
    expert: ExpertModel | None = None,
    *,
    timeout_per_assert_s: float = 10.0,
    max_timeouts: int = 3,
) -> list[str]:
  """Next-turn prompts, one per agent (agent 0 = aux, agent 1 = main; N=1: main).

  Args:
    mode: one of MODES (aliases: feedback, signals, expert, edits).
    task: mapping with `prompt`, `test` (full test code) and `entry_point`.
    agent_completions: this turn's joint action, one raw completion per agent.
    prompt_history_per_agent: per agent, the prompts it saw at turns 1..t
      (this turn's included).
    response_history_per_agent: per agent, its responses at turns 1..t
      (this joint action's included).
    num_agents: 1 or 2.
    sandbox_slice: which asserts the feedback runs (see `parse_sandbox_slice`).
    expert: the expert model for `expert_edits`.
    timeout_per_assert_s, max_timeouts: the per-assert alarm and timeout cap.

  Returns:
    `num_agents` prompt strings.
  """
  mode = _check_args(
      mode,
      task,
      agent_completions,
      prompt_history_per_agent,
      response_history_per_agent,
      num_agents,
      expert,
  )
  if mode == "bandit":
    return [hist[0] for hist in prompt_history_per_agent]
  labels = (
      ["your previous responses"]
      if num_agents == 1
      else ["your previous aux(...) responses", "your previous main responses"]
  )
  blocks = _mode_blocks(
      mode,
      task,
      agent_completions,
      num_agents,
      sandbox_slice,
      expert,
      timeout_per_assert_s,
      max_timeouts,
  )
  return [
      "\n".join(_history(prompts, responses, label) + block)
      for prompts, responses, label, block in zip(
          prompt_history_per_agent, response_history_per_agent, labels, blocks
      )
  ]


def revision_blocks(
    mode: str,
    task: Mapping[str, str],
    agent_completions: Sequence[str],
    num_agents: int = 2,
    sandbox_slice: int | str | None = 1,
    expert: ExpertModel | None = None,
    *,
    turn1_prompts: Sequence[str] | None = None,
    timeout_per_assert_s: float = 10.0,
    max_timeouts: int = 3,
) -> list[str]:
  """What `build_transition` puts after each agent's history, without the history.

  For chat-native environments whose threads already hold every agent's
  history: the next user turn is just the mode block and the closing
  instruction. `build_transition(...)[i]` equals the history part of agent i
  followed by `revision_blocks(...)[i]` (joined by a newline) in every mode
  but `bandit`, whose block is the agent's turn-1 prompt (given as
  `turn1_prompts`).

  Args:
    mode, task, agent_completions, num_agents, sandbox_slice, expert,
      timeout_per_assert_s, max_timeouts: as `build_transition`.
    turn1_prompts: each agent's turn-1 prompt; needed for mode 'bandit' only.

  Returns:
    `num_agents` strings.
  """
  if turn1_prompts is not None and len(turn1_prompts) != num_agents:
    raise ValueError(
        f"turn1_prompts must hold one prompt per agent ({num_agents}), got {len(turn1_prompts)}"
    )
  canonical = _ALIASES.get(str(mode).lower(), str(mode).lower())
  if canonical == "bandit" and not (turn1_prompts and all(turn1_prompts)):
    raise ValueError("external mode 'bandit' needs each agent's turn-1 prompt (turn1_prompts=)")
  prompt_hist = (
      [[p] for p in turn1_prompts] if turn1_prompts is not None else [[] for _ in agent_completions]
  )
  response_hist = [[c] for c in agent_completions]
  mode = _check_args(mode, task, agent_completions, prompt_hist, response_hist, num_agents, expert)
  if mode == "bandit":
    return list(turn1_prompts)
  return [
      "\n".join(block)
      for block in _mode_blocks(
          mode,
          task,
          agent_completions,
          num_agents,
          sandbox_slice,
          expert,
          timeout_per_assert_s,
          max_timeouts,
      )
  ]
