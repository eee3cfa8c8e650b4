"""Edits proposed by an expert model: the `expert_edits` mode of the code task's
feedback transitions (`mtrl_jax/tasks/code/feedback.py`; docs/comlrl.md section 1.4).

The expert is any `expert(prompt) -> str` callable; it is asked, in the
reference's wording, for JSON `{"aux": ..., "main": ...}` (`{"main": ...}`
for one agent); the last JSON object of its answer is read, with
`EXPERT_RETRIES` tries, and empty edits when every try fails.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Mapping

from mtrl_jax.tasks.code import analysis

EXPERT_RETRIES = 3

ExpertModel = Callable[[str], str]


def _last_json_object(text: str) -> dict:
  for candidate in reversed(re.findall(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", text, re.DOTALL)):
    try:
      parsed = json.loads(candidate)
    except json.JSONDecodeError:
      continue
    if isinstance(parsed, dict):
      return parsed
  raise ValueError("no JSON object in the expert's answer")


def expert_prompt(task: Mapping[str, str], aux: str, main: str, num_agents: int) -> str:
  """The request sent to the expert model (reference wording)."""
  prompt = task["prompt"]
  imports = analysis.extract_imports(prompt)
  guide = (
      "Guidelines:\n1) If {missing}, provide a minimal correct implementation as the edit.\n"
      "2) If {exists}, provide concise edits that would help pass the provided unit tests.\n"
      '3) If no changes are needed, respond with short note: "Perfect! No changes needed!" '
      "for that field.\n\n"
  )
  if num_agents == 1:
    return (
        f"You are an expert reviewing code written by a single agent for the task: {prompt}\n\n"
        "Your job is to return proposed edits for the main function as JSON with the key "
        "'main'.\n"
        + guide.format(missing="the target function is missing", exists="it exists")
        + 'Provide only JSON in the following format: { "main": <string with edits or '
        "replacement> }\nHere is the current code to consider:\n"
        f"{analysis.combine_code('', main, imports)}\n"
    )
  return (
      f"You are an expert reviewing code collaboratively written by two agents for the task: "
      f"{prompt}\nThe auxiliary agent implements a helper function (aux), and the main agent "
      "implements the task entry function.\n\nYour job is to return proposed edits for each "
      "agent as JSON with keys 'aux' and 'main'.\n"
      + guide.format(missing="a function is missing", exists="both exist")
      + 'Provide only JSON in the following format: { "aux": <string with edits or '
      'replacement>, "main": <string with edits or replacement> }\nHere is the current '
      f"combined code to consider:\n{analysis.combine_code(aux, main, imports)}\n"
  )


def request_expert_edits(
    expert: ExpertModel,
    task: Mapping[str, str],
    aux: str,
    main: str,
    num_agents: int,
    retries: int = EXPERT_RETRIES,
) -> tuple[str, str]:
  """(aux_edits, main_edits) from the expert; ("", "") if every try fails."""
  request = expert_prompt(task, aux, main, num_agents)
  for _ in range(retries):
    try:
      parsed = _last_json_object(expert(request))
      return str(parsed.get("aux", "")), str(parsed.get("main", ""))
    except Exception:  # a failing expert only costs the edits, as in the reference
      continue
  return "", ""
