"""Tokenizers: byte-level ids and round trips, HF `tokenizers` wrapper built locally."""

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from mtrl_jax.text import DEFAULT_SPECIALS, ByteTokenizer, HFTokenizer
from mtrl_jax.text import tokenizer as tokenizer_lib


def test_byte_special_ids_fixed_order_and_vocab_fits_tiny_presets():
  tok = ByteTokenizer()
  assert tok.special_tokens == DEFAULT_SPECIALS
  assert [tok.token_to_id(s) for s in DEFAULT_SPECIALS] == list(range(256, 268))
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
  assert tok.vocab_size == 268 <= 300  # `tiny` preset vocab
  extra = ByteTokenizer(extra_specials=("<|im_start|>", "<|im_end|>"))
  assert extra.token_to_id("<|im_start|>") == 268 and extra.vocab_size == 270
  assert isinstance(tok, tokenizer_lib.Tokenizer)


def test_byte_encode_bytes_and_specials():
  tok = ByteTokenizer()
  # Hand-worked: 'é' is C3 A9, '🙂' is F0 9F 99 82 in UTF-8.
  assert tok.encode("aé🙂") == [0x61, 0xC3, 0xA9, 0xF0, 0x9F, 0x99, 0x82]
  assert tok.encode("<answer>7</answer>") == [266, ord("7"), 267]
  assert tok.encode("x<|end|>") == [ord("x"), 263]
  assert tok.encode("hi", add_bos=True) == [257, ord("h"), ord("i")]
  assert tok.encode("") == []


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii",
        "héllo wörld — 数学 🙂",
        "<|user|>2+3<|end|><|assistant|>",
        '<tool_call>{"name":"calc","arguments":{"x":"ü"}}</tool_call>',
        "<answer<answer>>",
        "",
        "\n\t\x00",
    ],
)
def test_byte_round_trip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.encode(tok.decode(ids)) == ids
  assert all(0 <= i < tok.vocab_size for i in ids)


def test_byte_longest_special_match():
  tok = ByteTokenizer(extra_specials=("<x>", "<x>y"))
  short, long = tok.token_to_id("<x>"), tok.token_to_id("<x>y")
  assert tok.encode("<x>y") == [long]
  assert tok.encode("<x>z") == [short, ord("z")]
  assert tok.encode("<x>y<x>") == [long, short]


def test_byte_invalid_utf8_decodes_with_replacement_and_is_detectable():
  tok = ByteTokenizer()
  truncated = [0xE2, 0x82]  # first two bytes of '€' (E2 82 AC)
  assert tok.decode(truncated) == "\ufffd"
  assert tok.encode(tok.decode(truncated)) != truncated
  # A special token between the bytes of one character splits the character.
  split = [0xC3, tok.token_to_id("<|end|>"), 0xA9]
  assert tok.decode(split) == "\ufffd<|end|>\ufffd"
  assert tok.encode(tok.decode(split)) != split
  # Bytes of a special string are not the special id.
  spelled = list(b"<answer>")
  assert tok.decode(spelled) == "<answer>"
  assert tok.encode("<answer>") == [266] != spelled


def test_byte_errors():
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match=r"id 268 outside \[0, 268\)"):
    tok.decode([1, 268])
  with pytest.raises(ValueError, match="repeated"):
    ByteTokenizer(extra_specials=("<|end|>",))
  with pytest.raises(ValueError, match="non-empty"):
    ByteTokenizer(extra_specials=("",))
  with pytest.raises(ValueError, match="must include '<eos>'"):
    ByteTokenizer(specials=("<pad>",))
  with pytest.raises(ValueError, match="no single token 'ab'"):
    tok.token_to_id("ab")
  with pytest.raises(TypeError, match="expects str"):
    tok.encode(b"bytes")
  assert tok.token_to_id("a") == 97 and tok.id_to_token(263) == "<|end|>"


def _train_bpe():
  """A small byte-level BPE with Qwen-like special tokens, trained here (no downloads)."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=320,
      special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  corpus = [
      "hello world",
      "hello there, how are you?",
      "user assistant system tool",
      "the answer is 42",
      "call the calculator tool",
  ] * 4
  tok.train_from_iterator(corpus, trainer=trainer)
  # Like Qwen: chat specials are added after training, with the next free ids.
  tok.add_special_tokens(
      [
          AddedToken(t, special=True, normalized=False)
          for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
      ]
  )
  return tok


@pytest.fixture
def hf_dir(tmp_path):
  tok = _train_bpe()
  tok.save(str(tmp_path / "tokenizer.json"))
  n = tok.get_vocab_size(with_added_tokens=True)
  added = {
      str(tok.token_to_id(t)): {"content": t, "special": True}
      for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
  }
  added[str(n)] = {"content": "<answer>", "special": True}  # only in the config
  cfg = {
      "eos_token": "<|im_end|>",
      "pad_token": {"content": "<|endoftext|>"},
      "bos_token": None,
      "added_tokens_decoder": added,
  }
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return tmp_path


def test_hf_from_dir_reads_config(hf_dir):
  raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
  tok = HFTokenizer.from_dir(str(hf_dir))
  assert tok.eos_id == raw.token_to_id("<|im_end|>")
  assert tok.pad_id == raw.token_to_id("<|endoftext|>") == 0
  assert tok.bos_id is None
  # The config-only added token got the id the config names.
  n = raw.get_vocab_size(with_added_tokens=True)
  assert tok.token_to_id("<answer>") == n and tok.vocab_size == n + 1
  assert isinstance(tok, tokenizer_lib.Tokenizer)


def test_hf_encode_decode(hf_dir):
  tok = HFTokenizer.from_dir(str(hf_dir))
  start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
  text = "<|im_start|>user\nhello wörld 🙂<|im_end|>\n"
  ids = tok.encode(text)
  assert ids[0] == start and ids.count(end) == 1  # specials are single ids, no BOS added
  assert tok.decode(ids) == text
  assert tok.encode(tok.decode(ids)) == ids
  assert tok.encode("<tool_call>") == [tok.token_to_id("<tool_call>")]
  with pytest.raises(ValueError, match="add_bos=True"):
    tok.encode("x", add_bos=True)
  with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
    tok.token_to_id("<nope>")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])


def test_hf_config_disagreeing_with_tokenizer_json(hf_dir):
  cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
  cfg["added_tokens_decoder"] = {"5": {"content": "<|im_end|>", "special": True}}
  (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="'<\\|im_end\\|>' has id 5"):
    HFTokenizer.from_dir(str(hf_dir))


def test_hf_without_config_and_missing_dir(hf_dir, tmp_path):
  (hf_dir / "tokenizer_config.json").unlink()
  tok = HFTokenizer.from_dir(str(hf_dir))
  assert tok.eos_id is None and tok.pad_id == 0
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    HFTokenizer.from_dir(str(tmp_path / "nowhere"))
