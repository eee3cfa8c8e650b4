"""Tokenizers behind one small protocol: byte-level for tiny models, HF `tokenizers` for real ones.

Both map special-token strings found in the text to their single id, never add
a BOS unless asked, and decode without skipping anything, so that
`encode(decode(ids)) == ids` is the round-trip property the chat renderer
checks on every policy completion (docs/design.md invariant 1).
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

# Order fixes the ids (256, 257, ...); appending is safe, reordering breaks checkpoints.
DEFAULT_SPECIALS = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
)
NUM_BYTES = 256


@runtime_checkable
class Tokenizer(Protocol):
  """What the renderer, sampler and packer need from a tokenizer."""

  vocab_size: int
  pad_id: int
  eos_id: Optional[int]

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ...

  def decode(self, ids: Iterable[int]) -> str:
    ...

  def token_to_id(self, token: str) -> int:
    ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, special tokens as ids 256.. in a fixed order.

  Every string is encodable, so a from-scratch model needs no trained vocab;
  specials keep demo episodes short (one id per role or tag).
  """

  def __init__(
      self, extra_specials: Sequence[str] = (), specials: Sequence[str] = DEFAULT_SPECIALS
  ):
    """Builds the tokenizer.

    Args:
      extra_specials: appended after `specials` (ids continue from there).
      specials: the base special tokens; must contain `<pad>` and `<eos>`.
    """
    all_specials = tuple(specials) + tuple(extra_specials)
    for s in all_specials:
      if not isinstance(s, str) or not s:
        raise ValueError(f"ByteTokenizer special tokens must be non-empty strings, got {s!r}")
    dupes = sorted({s for s in all_specials if all_specials.count(s) > 1})
    if dupes:
      raise ValueError(f"ByteTokenizer special tokens repeated: {dupes}")
    for required in ("<pad>", "<eos>"):
      if required not in all_specials:
        raise ValueError(
            f"ByteTokenizer specials must include {required!r}; got {list(all_specials)}"
        )
    self.special_tokens = all_specials
    self._special_to_id = {s: NUM_BYTES + i for i, s in enumerate(all_specials)}
    # Longest alternative first: Python's regex takes the first alternative that
    # matches at the leftmost position, which makes this a longest match.
    ordered = sorted(all_specials, key=len, reverse=True)
    self._special_re = re.compile("|".join(re.escape(s) for s in ordered))
    self.vocab_size = NUM_BYTES + len(all_specials)
    self.pad_id = self._special_to_id["<pad>"]
    self.eos_id = self._special_to_id["<eos>"]
    self.bos_id = self._special_to_id.get("<bos>")

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Specials (longest match) become their id, everything else its UTF-8 bytes."""
    if not isinstance(text, str):
      raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
    ids = []
    if add_bos:
      if self.bos_id is None:
        raise ValueError("ByteTokenizer.encode(add_bos=True) but '<bos>' is not a special token")
      ids.append(self.bos_id)
    pos = 0
    for m in self._special_re.finditer(text):
      ids.extend(text[pos : m.start()].encode("utf-8"))
      ids.append(self._special_to_id[m.group()])
      pos = m.end()
    ids.extend(text[pos:].encode("utf-8"))
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Inverse of `encode`; invalid UTF-8 becomes U+FFFD (so it will not round-trip)."""
    parts, buf = [], bytearray()
    for i in ids:
      i = int(i)
      if 0 <= i < NUM_BYTES:
        buf.append(i)
      elif NUM_BYTES <= i < self.vocab_size:
        # Bytes are decoded per run between specials, as encode produced them.
        parts.append(buf.decode("utf-8", errors="replace"))
        buf = bytearray()
        parts.append(self.special_tokens[i - NUM_BYTES])
      else:
        raise ValueError(f"ByteTokenizer.decode: id {i} outside [0, {self.vocab_size})")
    parts.append(buf.decode("utf-8", errors="replace"))
    return "".join(parts)

  def token_to_id(self, token: str) -> int:
    """Id of a special token or of a one-byte string."""
    if token in self._special_to_id:
      return self._special_to_id[token]
    raw = token.encode("utf-8")
    if len(raw) == 1:
      return raw[0]
    raise ValueError(
        f"ByteTokenizer has no single token {token!r}; special tokens: {list(self.special_tokens)}"
    )

  def id_to_token(self, token_id: int) -> str:
    """The special string, or the byte as a latin-1 character (one char per id)."""
    if 0 <= token_id < NUM_BYTES:
      return bytes([token_id]).decode("latin-1")
    if NUM_BYTES <= token_id < self.vocab_size:
      return self.special_tokens[token_id - NUM_BYTES]
    raise ValueError(f"ByteTokenizer: id {token_id} outside [0, {self.vocab_size})")


def _token_content(entry) -> Optional[str]:
  """tokenizer_config.json writes tokens as a string or as {"content": ...}."""
  if entry is None or isinstance(entry, str):
    return entry
  if isinstance(entry, dict) and isinstance(entry.get("content"), str):
    return entry["content"]
  raise ValueError(f"tokenizer_config.json: cannot read a token from {entry!r}")


class HFTokenizer:
  """A `tokenizers.Tokenizer` (HF `tokenizer.json`) behind the `Tokenizer` protocol."""

  def __init__(
      self,
      tokenizer,
      *,
      eos_token: Optional[str] = None,
      pad_token: Optional[str] = None,
      bos_token: Optional[str] = None,
  ):
    """Wraps a loaded tokenizer.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      eos_token: end-of-sequence token string (must be in the vocab), or None.
      pad_token: padding token string; default: the EOS token, else id 0
        (padding positions are always masked, so any valid id works).
      bos_token: beginning-of-sequence token string, or None.
    """
    self._tok = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._required_id(eos_token, "eos_token") if eos_token else None
    self.bos_id = self._required_id(bos_token, "bos_token") if bos_token else None
    if pad_token:
      self.pad_id = self._required_id(pad_token, "pad_token")
    else:
      self.pad_id = self.eos_id if self.eos_id is not None else 0

  @classmethod
  def from_dir(cls, path: str) -> "HFTokenizer":
    """Loads `path/tokenizer.json`, plus `path/tokenizer_config.json` when present.

    The config supplies eos/pad/bos tokens; its `added_tokens_decoder` entries
    must agree with the ids in `tokenizer.json` (a missing one is added when
    its id is the next free id, otherwise loading fails).
    """
    import tokenizers  # Optional at import time: only real checkpoints need it.

    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"HFTokenizer.from_dir: no tokenizer.json in {path!r}")
    tok = tokenizers.Tokenizer.from_file(tok_file)
    cfg = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_file):
      with open(cfg_file) as f:
        cfg = json.load(f)
    added = cfg.get("added_tokens_decoder") or {}
    for id_str, entry in sorted(added.items(), key=lambda kv: int(kv[0])):
      content, want = _token_content(entry), int(id_str)
      have = tok.token_to_id(content)
      if have is None and want == tok.get_vocab_size(with_added_tokens=True):
        special = bool(entry.get("special", True)) if isinstance(entry, dict) else True
        tokens = [tokenizers.AddedToken(content, special=special, normalized=False)]
        if special:
          tok.add_special_tokens(tokens)
        else:
          tok.add_tokens(tokens)
        have = tok.token_to_id(content)
      if have != want:
        raise ValueError(
            f"tokenizer_config.json added_tokens_decoder says {content!r} has id {want}, "
            f"tokenizer.json gives {have}"
        )
    for content in cfg.get("additional_special_tokens") or ():
      content = _token_content(content)
      if tok.token_to_id(content) is None:
        raise ValueError(
            f"tokenizer_config.json additional_special_tokens: {content!r} "
            f"is not in tokenizer.json"
        )
    return cls(
        tok,
        eos_token=_token_content(cfg.get("eos_token")),
        pad_token=_token_content(cfg.get("pad_token")),
        bos_token=_token_content(cfg.get("bos_token")),
    )

  def _required_id(self, token: str, field: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"HFTokenizer {field}={token!r} is not in the vocabulary")
    return token_id

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Token ids of `text`; added/special token strings map to their id; no template."""
    if not isinstance(text, str):
      raise TypeError(f"HFTokenizer.encode expects str, got {type(text).__name__}")
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos:
      if self.bos_id is None:
        raise ValueError("HFTokenizer.encode(add_bos=True) but the tokenizer has no bos_token")
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, special tokens included."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"HFTokenizer.decode: ids {bad[:5]} outside [0, {self.vocab_size})")
    return self._tok.decode(ids, skip_special_tokens=False)

  def token_to_id(self, token: str) -> int:
    """Id of a single vocabulary entry (raises if absent)."""
    return self._required_id(token, "token")

  def id_to_token(self, token_id: int) -> str:
    token = self._tok.id_to_token(int(token_id))
    if token is None:
      raise ValueError(f"HFTokenizer: id {token_id} outside [0, {self.vocab_size})")
    return token
