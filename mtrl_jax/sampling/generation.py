"""Text-generation services shared by LLM judges and user simulators.

`TextGenerator` is what they need from a language model: `generate` (one
reply per plain-text user prompt) and `score_choices` (log-probs of choice
strings as the reply). `ScriptedGenerator` is a deterministic one for tests
and debugging.

`LocalLLM(model, tokenizer)` renders each prompt as one user turn of the
model's chat format and
  * `generate` samples the assistant reply with `mtrl_jax.sampling.Sampler`
    (one batched call for all prompts; stops on the format's stop ids);
  * `score_choices` runs one batched full forward over every
    (prompt, choice) pair and sums the log-probs of the choice's tokens after
    the assistant header: log p(choice | prompt), which the judges turn into
    P(PASS) or an expected 1-5 rating.

`BatchingGenerator` wraps any generator so that calls made at the same time
from many environment threads (one per trajectory) are merged into one model
call: judges and user simulators batch across trajectories without the
environment API changing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtrl_jax.buckets import next_pow2
from mtrl_jax.resources import SharedResource
from mtrl_jax.sampling.sampler import Sampler, SamplingConfig
from mtrl_jax.text import ChatRenderer, TokenLedger, chatml, compact


def _default_format(tokenizer):
  try:
    return chatml(tokenizer)
  except ValueError:  # no <|im_start|>: a byte tokenizer with the compact specials
    return compact(tokenizer)


@runtime_checkable
class TextGenerator(Protocol):
  """What judges and LLM user simulators need from a language model.

  `generate(prompts, sampling=None) -> list[str]`: one completion per prompt
  (each prompt is the text of one user message; the generator applies its
  chat format). `score_choices(prompts, choices) -> [P, C] array`: log-prob
  of each choice string as the start of the assistant's reply to each prompt.
  `LocalLLM` below implements it on our sampler. Prompts are plain text and
  replies plain strings: nothing here depends on the environment API.
  """

  def generate(self, prompts: Sequence[str], sampling: Any = None) -> list[str]:
    ...

  def score_choices(self, prompts: Sequence[str], choices: Sequence[str]) -> Any:
    ...


class ScriptedGenerator(SharedResource):
  """A deterministic `TextGenerator` for tests and debugging.

  Args:
    replies: a list of completions handed out in order (cycled), or a
      function prompt -> completion.
    scores: a function (prompt, choices) -> list of log-probs, one per choice.
  """

  fault_source = "judge"  # see LocalLLM

  def __init__(self, replies: Union[Sequence[str], Callable[[str], str], None] = None,
               scores: Optional[Callable[[str, Sequence[str]], Sequence[float]]] = None):
    self.replies = replies
    self.scores = scores
    self.prompts: list[str] = []  # every prompt seen, in order
    self.calls = 0  # batched calls made
    self._next = 0

  def generate(self, prompts, sampling=None):
    del sampling
    self.calls += 1
    out = []
    for p in prompts:
      self.prompts.append(p)
      if callable(self.replies):
        out.append(self.replies(p))
      elif self.replies:
        out.append(self.replies[self._next % len(self.replies)])
        self._next += 1
      else:
        raise ValueError("ScriptedGenerator.generate: no replies configured")
    return out

  def score_choices(self, prompts, choices):
    if self.scores is None:
      raise ValueError("ScriptedGenerator.score_choices: no scores function configured")
    self.calls += 1
    self.prompts.extend(prompts)
    return np.asarray([list(self.scores(p, choices)) for p in prompts], dtype=np.float64)


class LocalLLM(SharedResource):
  """`TextGenerator` over a local `mtrl_jax.models.Transformer`.

  Thread-safe (one lock around model calls); shared, not copied, when an
  environment forks.

  Args:
    model: the judge / simulator model (its weights are split once; use
      `set_state` to swap them).
    tokenizer: a `mtrl_jax.text.Tokenizer`.
    fmt: the chat format (default: chatml if the tokenizer has its tokens,
      else compact).
    sampling: default `SamplingConfig` of `generate`.
    seed: PRNG seed of `generate` (each call uses a fresh subkey).
    sampler: a `Sampler` for the model's config (default: a new one).
  """

  # What a fault raised inside a generator call is attributed to
  # (`mtrl_jax.envs.fault_source`): judges are its main users.
  fault_source = "judge"

  def __init__(self, model, tokenizer, fmt=None, *, sampling: Optional[SamplingConfig] = None,
               seed: int = 0, sampler: Optional[Sampler] = None):
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    self.tokenizer = tokenizer
    self.fmt = fmt if fmt is not None else _default_format(tokenizer)
    self.renderer = ChatRenderer(tokenizer, self.fmt)
    self.sampling = sampling or SamplingConfig(temperature=1.0, max_new_tokens=128)
    self.sampler = sampler or Sampler(self.cfg)
    self._key = jax.random.key(seed)
    self._lock = threading.Lock()
    self._score_traces = 0
    self._score_fn = jax.jit(self._token_logprobs)

  def set_state(self, state) -> None:
    """Swaps in new weights of the same graph (no recompilation)."""
    with self._lock:
      self.state = state

  @property
  def num_score_compiles(self) -> int:
    return self._score_traces

  def prompt_ids(self, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn followed by the assistant header."""
    ledger = TokenLedger()
    self.renderer.render_turn(ledger, "user", prompt)
    return self.renderer.begin_assistant(ledger)

  # ---------------------------------------------------------------- generate
  def generate(self, prompts: Sequence[str], sampling: Optional[SamplingConfig] = None
               ) -> list[str]:
    """One sampled reply per prompt (stop token removed)."""
    if not prompts:
      return []
    sampling = sampling or self.sampling
    ids = [self.prompt_ids(p) for p in prompts]
    with self._lock:
      self._key, key = jax.random.split(self._key)
      res = self.sampler.generate(self.state, ids, 1, sampling, key, self.fmt.stop_ids,
                                  self.tokenizer.pad_id)
    out = []
    for row in range(len(prompts)):
      n = int(res.lengths[row])
      if res.finish_reason[row] == "stop":
        n -= 1
      out.append(self.tokenizer.decode(res.tokens[row, :n].tolist()))
    return out

  # ----------------------------------------------------------- choice scores
  def _token_logprobs(self, state, tokens_BxL):
    """logp_BxL[b, t] = log p(tokens[b, t] | tokens[b, :t]); 0 at t = 0."""
    self._score_traces += 1
    model = nnx.merge(self.graphdef, state)
    logits_BxLxV = model(tokens_BxL).astype(jnp.float32)
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV[:, :-1], axis=-1)
    picked_BxL = jnp.take_along_axis(logp_BxLxV, tokens_BxL[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked_BxL, ((0, 0), (1, 0)))

  def score_choices(self, prompts: Sequence[str], choices: Sequence[str]) -> np.ndarray:
    """log p(choice | prompt) for every pair, as a float64 [P, C] array.

    Each choice is encoded on its own and placed right after the assistant
    header; its log-prob is the sum over its tokens. Rows are right-padded
    (causal attention: padding after a sequence cannot change it) and padded
    to power-of-two shapes, so the forward compiles once per bucket.
    """
    if not prompts:
      return np.zeros((0, len(choices)))
    choice_ids = [self.tokenizer.encode(c) for c in choices]
    for c, ids in zip(choices, choice_ids):
      if not ids:
        raise ValueError(f"score_choices: choice {c!r} encodes to no tokens")
    seqs, spans = [], []
    for p in prompts:
      base = self.prompt_ids(p)
      for ids in choice_ids:
        seqs.append(base + ids)
        spans.append((len(base), len(base) + len(ids)))
    length = next_pow2(max(len(s) for s in seqs), 16)
    if length > self.cfg.max_seq_len:
      raise ValueError(f"score_choices: {max(len(s) for s in seqs)} tokens exceed the judge's "
                       f"max_seq_len={self.cfg.max_seq_len}")
    rows = next_pow2(len(seqs), 1)
    tokens_BxL = np.full((rows, length), self.tokenizer.pad_id, np.int32)
    for i, s in enumerate(seqs):
      tokens_BxL[i, :len(s)] = s
    with self._lock:
      logp_BxL = np.asarray(jax.device_get(self._score_fn(self.state, tokens_BxL)),
                            np.float64)
    scores = np.array([logp_BxL[i, a:b].sum() for i, (a, b) in enumerate(spans)])
    return scores.reshape(len(prompts), len(choices))


class _Request:
  __slots__ = ("kind", "key", "prompts", "result", "error", "done")

  def __init__(self, kind, key, prompts):
    self.kind, self.key, self.prompts = kind, key, list(prompts)
    self.result, self.error, self.done = None, None, threading.Event()


class BatchingGenerator(SharedResource):
  """Merges concurrent `generate` / `score_choices` calls into one model call.

  The first caller waits `max_wait_s` for others to join, then runs one inner
  call per (kind, sampling or choices) group, at most `max_batch` prompts
  each, and hands every caller its rows.

  Args:
    inner: the generator doing the work (e.g. a `LocalLLM`).
    max_wait_s: how long the first caller waits for company.
    max_batch: most prompts per inner call.
  """

  fault_source = "judge"  # see LocalLLM

  def __init__(self, inner, max_wait_s: float = 0.005, max_batch: int = 256):
    if max_batch < 1 or max_wait_s < 0:
      raise ValueError(f"BatchingGenerator: max_batch={max_batch} must be >= 1 and "
                       f"max_wait_s={max_wait_s} >= 0")
    self.inner = inner
    self.max_wait_s = max_wait_s
    self.max_batch = max_batch
    self._lock = threading.Lock()
    self._pending: list[_Request] = []
    self._leading = False
    self.inner_calls = 0

  def generate(self, prompts, sampling=None) -> list[str]:
    return self._submit("generate", sampling, prompts)

  def score_choices(self, prompts, choices) -> np.ndarray:
    return np.asarray(self._submit("score", tuple(choices), prompts)).reshape(
        len(prompts), len(choices))

  def _submit(self, kind: str, key: Any, prompts):
    req = _Request(kind, key, prompts)
    with self._lock:
      self._pending.append(req)
      lead = not self._leading
      self._leading = True
    if lead:
      time.sleep(self.max_wait_s)  # let concurrent callers join this batch
      with self._lock:
        batch, self._pending, self._leading = self._pending, [], False
      self._run(batch)
    req.done.wait()
    if req.error is not None:
      raise req.error
    return req.result

  def _run(self, batch: list[_Request]) -> None:
    groups: dict = {}
    for r in batch:
      groups.setdefault((r.kind, r.key), []).append(r)
    for (kind, key), reqs in groups.items():
      # Chunks of whole requests, at most max_batch prompts (a larger request goes alone).
      chunk, size = [], 0
      for r in reqs + [None]:
        if r is None or (chunk and size + len(r.prompts) > self.max_batch):
          self._call(kind, key, chunk)
          chunk, size = [], 0
        if r is not None:
          chunk.append(r)
          size += len(r.prompts)

  def _call(self, kind, key, reqs: list[_Request]) -> None:
    prompts = [p for r in reqs for p in r.prompts]
    try:
      with self._lock:
        self.inner_calls += 1
      if kind == "generate":
        out = list(self.inner.generate(prompts, key))
      else:
        out = list(np.asarray(self.inner.score_choices(prompts, list(key))))
      start = 0
      for r in reqs:
        r.result = out[start:start + len(r.prompts)]
        start += len(r.prompts)
    except Exception as e:  # every waiting caller sees the failure
      for r in reqs:
        r.error = e
    finally:
      for r in reqs:
        r.done.set()
