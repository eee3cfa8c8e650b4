"""Turn-1 prompts of the code task (docs/comlrl.md section 3.1).

Raw text, no chat template, as in the reference: the aux agent writes a helper
`aux(...)`, the main agent writes the entry point (and may call aux); the
single-agent baseline writes the entry point alone. The parameter list of the
format line is regex-extracted from the first `def name(args)` of the problem;
when there is none (a zero-argument function) or no entry point, every
formatter returns the literal `EXTRACTION_ERROR` string, as the reference did.

Turn >= 2 (V2 without passthrough): the external transition's text is put in
place of the problem and formatted again, i.e. `aux_prompt({"prompt": text,
"entry_point": ep})`; with passthrough the text is used verbatim.
"""

from __future__ import annotations

import re
from typing import Mapping

EXTRACTION_ERROR = "Error: Could not extract function information from prompt."

_RULES = (
    "IMPORTANT INSTRUCTIONS:\n"
    "- Output ONLY the function code, no explanations or examples\n"
    "- Do NOT include markdown code blocks (```python)\n"
    "- Do NOT include any text before or after the function\n"
    "- Do NOT include test cases or example usage\n"
)


def extract_function_params(prompt: str) -> list[str]:
  """Parameters of the first `def name(args)` in `prompt` ([] if none)."""
  match = re.search(r"def\s+\w+\s*\(([^)]+)\)", prompt or "")
  if not match:
    return []
  return [p.strip() for p in match.group(1).split(",") if p.strip()]


def _fields(task: Mapping[str, str]) -> tuple[str, str, list[str]]:
  prompt, entry_point = task.get("prompt", ""), task.get("entry_point", "")
  return prompt, entry_point, extract_function_params(prompt)


def aux_prompt(task: Mapping[str, str]) -> str:
  """Prompt of the aux agent (agent 0)."""
  prompt, entry_point, params = _fields(task)
  if not params or not entry_point:
    return EXTRACTION_ERROR
  return (
      "Create a helper function for this coding problem.\n\n"
      f"Problem:\n{prompt}\n\n"
      + _RULES
      + "- Create a helper function named 'aux' that can assist the main function\n"
      "- The function should return useful data for solving the problem\n\n"
      "Your output should follow this format:\n\n"
      "def aux(...):\n # your function code here\nreturn result\n"
  )


def main_prompt(task: Mapping[str, str]) -> str:
  """Prompt of the main agent (agent 1), which may call aux."""
  prompt, entry_point, params = _fields(task)
  if not params or not entry_point:
    return EXTRACTION_ERROR
  return (
      "Solve this coding problem by implementing the required function.\n\n"
      f"Problem:\n{prompt}\n\n"
      "You have access to a helper function: aux(...)\n\n"
      + _RULES
      + "- Do NOT redefine the aux() function\n"
      f"- Implement ONLY the '{entry_point}' function as specified\n"
      "- You can call aux() to assign value to a variable within your function if helpful\n\n"
      "Your output should follow this format:\n\n"
      f"def {entry_point}({', '.join(params)}):\n # your function code here\nreturn result\n"
  )


def single_agent_prompt(task: Mapping[str, str]) -> str:
  """Prompt of the single-agent (GRPO) baseline."""
  prompt, entry_point, params = _fields(task)
  if not params or not entry_point:
    return EXTRACTION_ERROR
  return (
      "Solve this coding problem by implementing the required function.\n\n"
      f"Problem:\n{prompt}\n\n"
      + _RULES
      + f"- Implement ONLY the '{entry_point}' function as specified\n"
      "- Make sure your solution is complete and handles all cases\n\n"
      "Your output should follow this format:\n\n"
      f"def {entry_point}({', '.join(params)}):\n    # your function code here\n"
      "    return result\n"
  )


def agent_prompts(task: Mapping[str, str], num_agents: int) -> list[str]:
  """Turn-1 prompts, one per agent: [single] for N=1, [aux, main] for N=2."""
  if num_agents == 1:
    return [single_agent_prompt(task)]
  if num_agents == 2:
    return [aux_prompt(task), main_prompt(task)]
  raise ValueError(f"num_agents must be 1 or 2 for the code task, got {num_agents!r}")
