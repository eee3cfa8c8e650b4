"""Text-generation services shared by LLM judges and user simulators.

`TextGenerator` is what they need from a language model: `generate` (one
reply per plain-text user prompt) and `score_choices` (log-probs of choice
strings as the reply). `ScriptedGenerator` is a deterministic one for tests
and debugging.

`LocalLLM(model, tokenizer)` renders each prompt as one user turn of the
model's chat format and
  * `generate` samples the assistant reply on its own rollout engine
    (`mtrl_jax.sampling.engine.DecodeEngine`: every prompt one request with
    its own key; stops on the format's stop ids);
  * `score_choices` runs one batched full forward over every
    (prompt, choice) pair and sums the log-probs of the choice's tokens after
    the assistant header: log p(choice | prompt), which the judges turn into
    P(PASS) or an expected 1-5 rating.

`BatchingGenerator` (`mtrl_jax.sampling.batching`) wraps any generator so
that calls made at the same time from many environment threads (one per
trajectory) are merged into one model call: judges and user simulators batch
across trajectories without the environment API changing.

Reproducible calls: `generate(prompts, sampling, seeds=[...])` takes one seed
per prompt. The rollout derives each environment step's seed from the step's
key and the node's identity (`mtrl_jax.seeds.call_seed(step key, root, node,
action, agent, turn)`), so a reply depends on that seed and its prompt only:
not on the order in which environment threads happen to call, not on a
counter, and not on what else shares the batch. A resumed run therefore replays the same replies.
Without seeds `LocalLLM` draws from its own key stream (call order decides).
`score_choices` is deterministic and needs none.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtrl_jax.buckets import next_pow2, round_up
from mtrl_jax.resources import SharedResource
from mtrl_jax.sampling.batching import _check_seeds
from mtrl_jax.sampling.config import SamplingConfig
from mtrl_jax.sampling.engine import DecodeEngine
from mtrl_jax.sampling.slots import EngineConfig, Request
from mtrl_jax.text import ChatRenderer, TokenLedger, chatml, compact


@jax.jit
def _seed_keys(base_key, seeds_Px2):
  """Key of each seed: fold_in(fold_in(base_key, seed high 32 bits), low 32 bits)."""
  return jax.vmap(lambda hi, lo: jax.random.fold_in(jax.random.fold_in(base_key, hi), lo))(
      seeds_Px2[:, 0], seeds_Px2[:, 1]
  )


def _default_format(tokenizer):
  try:
    return chatml(tokenizer)
  except ValueError:  # no <|im_start|>: a byte tokenizer with the compact specials
    return compact(tokenizer)


@runtime_checkable
class TextGenerator(Protocol):
  """What judges and LLM user simulators need from a language model.

  `generate(prompts, sampling=None, seeds=None) -> list[str]`: one
  completion per prompt (each prompt is the text of one user message; the
  generator applies its chat format); `seeds` (one int per prompt) make each
  completion a function of its seed and prompt alone.
  `score_choices(prompts, choices) -> [P, C] array`: log-prob
  of each choice string as the start of the assistant's reply to each prompt.
  `LocalLLM` below implements it on our sampler. Prompts are plain text and
  replies plain strings: nothing here depends on the environment API.
  """

  def generate(
      self, prompts: Sequence[str], sampling: Any = None, seeds: Optional[Sequence[int]] = None
  ) -> list[str]:
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

  def __init__(
      self,
      replies: Union[Sequence[str], Callable[[str], str], None] = None,
      scores: Optional[Callable[[str, Sequence[str]], Sequence[float]]] = None,
  ):
    self.replies = replies
    self.scores = scores
    self.prompts: list[str] = []  # every prompt seen, in order
    self.seeds: list = []  # the seed given with each prompt (None: none), in order
    self.calls = 0  # batched calls made
    self._next = 0

  def generate(self, prompts, sampling=None, seeds=None):
    del sampling
    seeds = _check_seeds(seeds, len(prompts))
    self.calls += 1
    out = []
    for k, p in enumerate(prompts):
      self.prompts.append(p)
      self.seeds.append(None if seeds is None else seeds[k])
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
    seed: PRNG seed of `generate`: the base key that per-prompt `seeds` are
      folded into; calls without seeds use fresh subkeys of it in call order.
    max_len: cache columns of a slot (prompt + reply + 1; default: the
      model's max_seq_len, at most 2048).
    slots: decode slots (prompts decoded at once).
    fixed_rows: None: scoring calls padded to power-of-two shapes (fastest).
      An int R: every scoring call has exactly R rows of one length bucket, so
      a prompt's scores are a function of that prompt alone, never of what
      else shares the call: float rounding depends on array shapes, and a
      `BatchingGenerator` merges whatever calls arrive together. (Replies are
      always so: the engine's calls have fixed row counts.) The rollouts'
      reproducibility across thread counts needs this.
  """

  # What a fault raised inside a generator call is attributed to
  # (`mtrl_jax.envs.fault_source`): judges are its main users.
  fault_source = "judge"

  def __reduce__(self):
    # It samples on a model in this process: a pickled copy (a worker process of
    # env.workers='processes') would have none to call.
    raise TypeError(
        f"{type(self).__name__} samples on a model in the engine's process and cannot be "
        "pickled (an LLM judge or user simulator cannot run in a worker process)"
    )

  def __init__(
      self,
      model,
      tokenizer,
      fmt=None,
      *,
      sampling: Optional[SamplingConfig] = None,
      seed: int = 0,
      max_len: Optional[int] = None,
      slots: int = 64,
      fixed_rows: Optional[int] = None,
  ):
    if fixed_rows is not None and (
        isinstance(fixed_rows, bool) or not isinstance(fixed_rows, int) or fixed_rows < 1
    ):
      raise ValueError(f"LocalLLM fixed_rows={fixed_rows!r}; allowed: None or an int >= 1")
    self.fixed_rows = fixed_rows
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    self.tokenizer = tokenizer
    self.fmt = fmt if fmt is not None else _default_format(tokenizer)
    self.renderer = ChatRenderer(tokenizer, self.fmt)
    self.sampling = sampling or SamplingConfig(temperature=1.0, max_new_tokens=128)
    capacity = round_up(max_len or min(self.cfg.max_seq_len, 2048), 16)
    self.engine = DecodeEngine(
        self.cfg,
        EngineConfig(
            slots=fixed_rows or slots,
            capacity=capacity,
            decode_rows=fixed_rows or 0,
            admit_rows=fixed_rows or 8,
        ),
    )
    self._base_key = jax.random.key(seed)
    self._key = self._base_key
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

  def _groups(self, lengths: Sequence[int]) -> list[tuple[list[int], int]]:
    """Row indices per model call and the rows it pads to.

    Default: one call of every row, next_pow2 rows. With `fixed_rows` R:
    rows grouped by their own length bucket, chunks of R rows each.
    """
    n = len(lengths)
    if self.fixed_rows is None:
      return [(list(range(n)), next_pow2(n, 1))]
    by_bucket: dict = {}
    for i, length in enumerate(lengths):
      by_bucket.setdefault(next_pow2(length, 16), []).append(i)
    r = self.fixed_rows
    return [
        (rows[k : k + r], r)
        for _, rows in sorted(by_bucket.items())
        for k in range(0, len(rows), r)
    ]

  def prompt_ids(self, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn followed by the assistant header."""
    ledger = TokenLedger()
    self.renderer.render_turn(ledger, "user", prompt)
    return self.renderer.begin_assistant(ledger)

  # ---------------------------------------------------------------- generate
  def generate(
      self,
      prompts: Sequence[str],
      sampling: Optional[SamplingConfig] = None,
      seeds: Optional[Sequence[int]] = None,
  ) -> list[str]:
    """One sampled reply per prompt (stop token removed).

    Args:
      prompts: user messages.
      sampling: overrides the default `SamplingConfig`.
      seeds: one int per prompt; prompt p samples with the key
        fold_in(fold_in(key(seed), seeds[p] >> 32), seeds[p] & 0xffffffff),
        whatever else is in the call. None: a fresh subkey per call.
    """
    seeds = _check_seeds(seeds, len(prompts))
    if not prompts:
      return []
    sampling = sampling or self.sampling
    ids = [self.prompt_ids(p) for p in prompts]
    too_long = [
        len(x) for x in ids if len(x) + sampling.max_new_tokens + 1 > self.engine.cfg.capacity
    ]
    if too_long:
      raise ValueError(
          f"LocalLLM.generate: a prompt of {max(too_long)} tokens plus "
          f"{sampling.max_new_tokens} new ones exceeds max_len="
          f"{self.engine.cfg.capacity}"
      )
    prompt_keys = None
    if seeds is not None:
      halves = np.zeros((next_pow2(len(seeds), 1), 2), np.uint32)  # one program per bucket
      halves[: len(seeds)] = [[s >> 32, s & 0xFFFFFFFF] for s in seeds]
      prompt_keys = _seed_keys(self._base_key, halves)[: len(seeds)]
    with self._lock:
      if prompt_keys is None:
        self._key, key = jax.random.split(self._key)
        prompt_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(
            np.arange(len(prompts), dtype=np.uint32)
        )
      data = np.asarray(jax.random.key_data(prompt_keys), np.uint32)
      self.engine.start(self.state, sampling, self.fmt.stop_ids, self.tokenizer.pad_id, fanout=1)
      for p, prompt in enumerate(ids):
        self.engine.submit(Request(p, prompt, data[p], [0]))
      out = [""] * len(prompts)
      busy = True
      while busy:
        samples, busy = self.engine.step()
        for s in samples:
          n = len(s.ids) - (s.finish_reason == "stop")
          out[s.tag] = self.tokenizer.decode(s.ids[:n].tolist())
          self.engine.release(s.handle)
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
    if max(len(s) for s in seqs) > self.cfg.max_seq_len:
      raise ValueError(
          f"score_choices: {max(len(s) for s in seqs)} tokens exceed the judge's "
          f"max_seq_len={self.cfg.max_seq_len}"
      )
    scores = np.zeros(len(seqs))
    for rows, size in self._groups([len(s) for s in seqs]):
      length = min(next_pow2(max(len(seqs[i]) for i in rows), 16), self.cfg.max_seq_len)
      tokens_BxL = np.full((size, length), self.tokenizer.pad_id, np.int32)
      for b, i in enumerate(rows):
        tokens_BxL[b, : len(seqs[i])] = seqs[i]
      with self._lock:
        logp_BxL = np.asarray(jax.device_get(self._score_fn(self.state, tokens_BxL)), np.float64)
      for b, i in enumerate(rows):
        scores[i] = logp_BxL[b, spans[i][0] : spans[i][1]].sum()
    return scores.reshape(len(prompts), len(choices))
