"""Chat formats and the renderer that appends conversation turns to a `TokenLedger`.

Rendering is incremental: each turn is tokenised once, when it is appended,
and a policy completion is stored exactly as sampled (docs/design.md invariant 1).
The renderer checks whether the sampled ids would come back unchanged from
`encode(decode(ids))` and counts the completions where they would not; the
stored ids are never touched, since re-tokenising would train the policy on
tokens it did not sample.

Masks are the same for SFT and RL: only assistant content and the stop token
that ends it are trainable; headers, the framework's post-stop ids, and
system/user/tool turns never are.

Thinking models (`strip_thinking=True`, Qwen3's template): an assistant turn
that precedes the last user turn is shown without its reasoning (the text up
to its last `</think>` is dropped). So once a new user turn arrives, the
context no longer extends the tokens the policy sampled: the history is
rewritten. `context_view` gives the turns as the template shows them now;
the framework (`mtrl_jax.envs.render_thread`) then renders the rewritten
history into a new ledger, and the rollout trains the next action on that
new context while earlier actions keep their own tokens (a history rewrite,
counted as `text/history_rewrites`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Mapping, Optional, Sequence

from mtrl_jax.text.ledger import TokenLedger
from mtrl_jax.text.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """Token framing of a conversation.

  Attributes:
    name: a label for logs.
    headers: per role, the ids that open a turn (non-empty).
    footers: per role, the ids that close a turn. The assistant footer must be
      `(stop_ids[0],) + after_stop_ids`: what a completion that stops normally
      leaves in the ledger.
    stop_ids: ids that end a policy completion (the sampler's stop tokens).
    after_stop_ids: ids the framework appends after a sampled stop token.
  """

  name: str
  headers: Mapping[str, tuple]
  footers: Mapping[str, tuple]
  stop_ids: tuple
  after_stop_ids: tuple = ()

  def __post_init__(self):
    if set(self.headers) != set(self.footers):
      raise ValueError(
          f"ChatFormat {self.name}: header roles {sorted(self.headers)} differ "
          f"from footer roles {sorted(self.footers)}"
      )
    if "assistant" not in self.headers:
      raise ValueError(f"ChatFormat {self.name}: needs an 'assistant' role")
    for role, header in self.headers.items():
      if not header:
        # A non-empty header keeps position 0 of any ledger non-trainable.
        raise ValueError(f"ChatFormat {self.name}: empty header for role {role!r}")
    if not self.stop_ids:
      raise ValueError(f"ChatFormat {self.name}: stop_ids must not be empty")
    want = (self.stop_ids[0],) + tuple(self.after_stop_ids)
    if tuple(self.footers["assistant"]) != want:
      raise ValueError(
          f"ChatFormat {self.name}: assistant footer {self.footers['assistant']} "
          f"must equal (stop_ids[0],) + after_stop_ids = {want}"
      )

  @property
  def roles(self) -> tuple:
    return tuple(self.headers)

  def _check_role(self, role: str) -> None:
    if role not in self.headers:
      raise ValueError(f"unknown chat role {role!r}; allowed roles: {list(self.headers)}")

  def header(self, role: str) -> tuple:
    self._check_role(role)
    return tuple(self.headers[role])

  def footer(self, role: str) -> tuple:
    self._check_role(role)
    return tuple(self.footers[role])


def _single_id(tokenizer: Tokenizer, token: str, fmt: str) -> int:
  try:
    token_id = tokenizer.token_to_id(token)
  except ValueError as e:
    raise ValueError(f"{fmt} format needs {token!r} as a single token: {e}") from e
  if tokenizer.encode(token) != [token_id]:
    raise ValueError(
        f"{fmt} format: encode({token!r}) is {tokenizer.encode(token)}, "
        f"not the single id {token_id}"
    )
  return token_id


def chatml(tokenizer: Tokenizer, roles: Sequence[str] = ROLES) -> ChatFormat:
  """Qwen-style ChatML: `<|im_start|>{role}\\n` ... `<|im_end|>\\n`.

  Stops on `<|im_end|>` (and on EOS when it is another token); the framework
  then appends the `\\n` the template puts after `<|im_end|>`.
  """
  start = _single_id(tokenizer, "<|im_start|>", "chatml")
  end = _single_id(tokenizer, "<|im_end|>", "chatml")
  newline = tuple(tokenizer.encode("\n"))
  headers = {r: (start,) + tuple(tokenizer.encode(f"{r}\n")) for r in roles}
  footers = {r: (end,) + newline for r in roles}
  stops = (end,) if tokenizer.eos_id in (None, end) else (end, tokenizer.eos_id)
  return ChatFormat("chatml", headers, footers, stops, newline)


def compact(tokenizer: Tokenizer, roles: Sequence[str] = ROLES) -> ChatFormat:
  """One special token per role as header, `<|end|>` as footer: short demo episodes.

  Stops on `<|end|>` (and on EOS); nothing is appended after the stop.
  """
  end = _single_id(tokenizer, "<|end|>", "compact")
  headers = {r: (_single_id(tokenizer, f"<|{r}|>", "compact"),) for r in roles}
  footers = {r: (end,) for r in roles}
  stops = (end,) if tokenizer.eos_id in (None, end) else (end, tokenizer.eos_id)
  return ChatFormat("compact", headers, footers, stops, ())


def _role_content(turn, content) -> tuple:
  """Accepts (role, content) or a Turn-like object with `.role` / `.content`."""
  if isinstance(turn, str):
    role = turn
  elif content is None and hasattr(turn, "role") and hasattr(turn, "content"):
    role, content = turn.role, turn.content
  elif content is None and isinstance(turn, (tuple, list)) and len(turn) == 2:
    role, content = turn
  else:
    raise TypeError(
        f"expected a role string with content, a (role, content) pair or an "
        f"object with .role and .content; got {turn!r}"
    )
  if not isinstance(content, str):
    raise TypeError(f"turn content must be str, got {type(content).__name__} for role {role!r}")
  return role, content


THINK_CLOSE = "</think>"


def strip_thinking(content: str) -> str:
  """An assistant message as Qwen3's template shows it in later turns: the text
  after its last `</think>`, leading newlines removed (unchanged without one)."""
  if THINK_CLOSE not in content:
    return content
  return content.split(THINK_CLOSE)[-1].lstrip("\n")


class ChatRenderer:
  """Appends turns to ledgers in one `ChatFormat`; counts re-tokenisation mismatches.

  Shared by all rollout threads: the counters are guarded by a lock.

  Args:
    tokenizer: the policy's tokenizer.
    fmt: the chat format.
    strip_thinking: Qwen3-style: assistant turns before the last user turn
      lose their thinking block in the context (`context_view`).
  """

  def __init__(self, tokenizer: Tokenizer, fmt: ChatFormat, *, strip_thinking: bool = False):
    if not isinstance(strip_thinking, bool):
      raise ValueError(f"ChatRenderer strip_thinking={strip_thinking!r}; allowed: True or False")
    self.tokenizer = tokenizer
    self.fmt = fmt
    self.strip_thinking = strip_thinking
    self.retokenize_mismatches = 0  # completions with encode(decode(ids)) != ids
    self.completions_checked = 0
    self.history_rewrites = 0  # threads whose context was rendered anew (`note_rewrite`)
    self._lock = threading.Lock()

  def context_view(self, turns: Sequence) -> list[tuple[str, str]]:
    """(role, content) of each turn as the template shows it before the next reply.

    Without `strip_thinking` every turn is shown as it is. With it, assistant
    turns before the last user turn show `strip_thinking(content)`.
    """
    pairs = [_role_content(t, None) for t in turns]
    if not self.strip_thinking:
      return pairs
    last_user = max((i for i, (role, _) in enumerate(pairs) if role == "user"), default=-1)
    return [
        (role, strip_thinking(content) if role == "assistant" and i < last_user else content)
        for i, (role, content) in enumerate(pairs)
    ]

  def note_rewrite(self) -> None:
    """Counts one thread whose history was rendered anew (a history rewrite)."""
    with self._lock:
      self.history_rewrites += 1

  def render_turn(
      self, ledger: TokenLedger, turn, content: Optional[str] = None, *, trainable: bool = False
  ) -> None:
    """Appends header + encode(content) + footer as a new turn.

    Args:
      ledger: appended to in place.
      turn: a role name (then pass `content`), or a Turn-like object.
      content: the turn's text when `turn` is a role name.
      trainable: SFT mode for assistant turns: content and stop token are
        trainable (header and post-stop ids never). Only allowed for 'assistant'.
    """
    role, content = _role_content(turn, content)
    header, footer = self.fmt.header(role), self.fmt.footer(role)
    if ledger.open_turn is not None:
      raise ValueError(
          f"render_turn({role!r}): assistant turn {ledger.open_turn} was begun "
          f"by begin_assistant and has no completion yet"
      )
    if trainable and role != "assistant":
      raise ValueError(f"render_turn: trainable=True only for role 'assistant', got {role!r}")
    index = ledger.num_turns
    ledger.extend(header, role=role, turn=index)
    ledger.extend(self.tokenizer.encode(content), role=role, turn=index, trainable=trainable)
    # The assistant footer is (stop, *after_stop); only the stop is policy output.
    n_policy = 1 if role == "assistant" else 0
    ledger.extend(footer[:n_policy], role=role, turn=index, trainable=trainable)
    ledger.extend(footer[n_policy:], role=role, turn=index)

  def begin_assistant(self, ledger: TokenLedger) -> list:
    """Appends the assistant header (not trainable); returns the whole prompt's ids."""
    if ledger.open_turn is not None:
      raise ValueError(f"begin_assistant: assistant turn {ledger.open_turn} is already open")
    index = ledger.num_turns
    ledger.extend(self.fmt.header("assistant"), role="assistant", turn=index)
    ledger.open_turn = index
    return list(ledger.ids)

  def append_completion(
      self,
      ledger: TokenLedger,
      ids: Sequence[int],
      logprobs: Sequence[float],
      finished_by_stop: Optional[bool] = None,
  ) -> str:
    """Appends a sampled completion exactly as sampled and closes the turn.

    Args:
      ledger: one begun by `begin_assistant` (or a copy of it).
      ids: sampled ids, the stop token last when `finished_by_stop`.
      logprobs: the sampler's logprob of each id.
      finished_by_stop: True when the completion ended on one of the format's
        stop ids, False when cut at the length limit; None infers it from the
        last id (the sampler stops at the first stop id, so the two agree).

    Returns:
      The completion's text without the stop token: the assistant turn's
      content as the environment sees it.

    The sampled ids are trainable with their logprobs; after a stop the
    format's post-stop ids follow (not trainable). A truncated completion is
    closed with the full assistant footer, not trainable (the policy never
    sampled it), so later turns render in a well-formed context.
    """
    if ledger.open_turn is None:
      raise ValueError("append_completion: call begin_assistant on this ledger first")
    ids = [int(i) for i in ids]
    logprobs = [float(x) for x in logprobs]
    if len(ids) != len(logprobs):
      raise ValueError(f"append_completion: {len(ids)} ids but {len(logprobs)} logprobs")
    if finished_by_stop is None:
      finished_by_stop = bool(ids) and ids[-1] in self.fmt.stop_ids
    if finished_by_stop and (not ids or ids[-1] not in self.fmt.stop_ids):
      raise ValueError(
          f"append_completion: finished_by_stop=True but the last id "
          f"{ids[-1] if ids else None} is not a stop id {self.fmt.stop_ids}"
      )
    index = ledger.open_turn
    ledger.extend(ids, role="assistant", turn=index, trainable=True, logprobs=logprobs)
    if finished_by_stop:
      ledger.extend(self.fmt.after_stop_ids, role="assistant", turn=index)
    else:
      ledger.extend(self.fmt.footer("assistant"), role="assistant", turn=index)
    ledger.open_turn = None
    mismatch = self.tokenizer.encode(self.tokenizer.decode(ids)) != ids
    with self._lock:
      self.completions_checked += 1
      self.retokenize_mismatches += int(mismatch)
    content = ids[:-1] if finished_by_stop else ids
    return self.tokenizer.decode(content)

  def render_conversation(
      self, messages: Iterable, ledger: Optional[TokenLedger] = None, train_assistant: bool = True
  ) -> TokenLedger:
    """Renders a whole conversation, e.g. SFT data.

    Args:
      messages: (role, content) pairs or Turn-like objects, in order.
      ledger: appended to when given; default: a new empty ledger.
      train_assistant: mark assistant content + stop token trainable.

    Returns:
      The ledger.
    """
    ledger = TokenLedger() if ledger is None else ledger
    for message in messages:
      role, content = _role_content(message, None)
      self.render_turn(ledger, role, content, trainable=train_assistant and role == "assistant")
    return ledger

  def add_counts(self, counts: dict) -> None:
    """Adds counters a copy of this renderer counted elsewhere (a worker process,
    `rollout.workers`), keyed as `metrics` names them."""
    with self._lock:
      self.completions_checked += counts.get("text/completions_checked", 0)
      self.retokenize_mismatches += counts.get("text/retokenize_mismatches", 0)
      self.history_rewrites += counts.get("text/history_rewrites", 0)

  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_lock"]  # a lock does not pickle; a copy gets its own
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def metrics(self) -> dict:
    """Counters for the run's metrics log."""
    with self._lock:
      checked, bad = self.completions_checked, self.retokenize_mismatches
      rewrites = self.history_rewrites
    return {
        "text/completions_checked": checked,
        "text/retokenize_mismatches": bad,
        "text/retokenize_mismatch_rate": bad / checked if checked else 0.0,
        "text/history_rewrites": rewrites,
    }
