"""Chat formats and the renderer: exact ids, masks, token-in/token-out, mismatch counting."""

import dataclasses

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from mtrl_jax.text import (
    ByteTokenizer,
    ChatFormat,
    ChatRenderer,
    HFTokenizer,
    TokenLedger,
    chatml,
    compact,
)

# Default ByteTokenizer specials (ids fixed by DEFAULT_SPECIALS order).
EOS, SYS, USER, ASST, TOOL, END, ANS, ANS_CLOSE = 258, 259, 260, 261, 262, 263, 266, 267


@dataclasses.dataclass
class FakeTurn:  # stands in for mtrl_jax.envs.Turn: anything with .role and .content
  role: str
  content: str


def _b(s):
  return list(s.encode("utf-8"))


@pytest.fixture
def compact_renderer():
  tok = ByteTokenizer()
  return ChatRenderer(tok, compact(tok))


def test_compact_format_ids():
  fmt = compact(ByteTokenizer())
  assert fmt.headers == {"system": (SYS,), "user": (USER,), "assistant": (ASST,), "tool": (TOOL,)}
  assert set(fmt.footers.values()) == {(END,)}
  assert fmt.stop_ids == (END, EOS) and fmt.after_stop_ids == ()


def test_render_conversation_ids_and_sft_mask(compact_renderer):
  led = compact_renderer.render_conversation(
      [("system", "S"), ("user", "2+3"), FakeTurn("assistant", "<answer>5</answer>"), ("tool", "x")]
  )
  # Hand-built: <|system|>S<|end|> <|user|>2+3<|end|> <|assistant|><answer>5</answer><|end|> ...
  want = (
      [SYS]
      + _b("S")
      + [END]
      + [USER]
      + _b("2+3")
      + [END]
      + [ASST, ANS]
      + _b("5")
      + [ANS_CLOSE, END]
      + [TOOL]
      + _b("x")
      + [END]
  )
  assert list(led.ids) == want
  # Only assistant content and its stop token are trainable; its header is not.
  trainable_ids = [i for i, t in zip(led.ids, led.trainable) if t]
  assert trainable_ids == [ANS, ord("5"), ANS_CLOSE, END]
  assert led.trainable[want.index(ASST)] is False
  assert led.turn == (0,) * 3 + (1,) * 5 + (2,) * 5 + (3,) * 3
  assert led.roles[8] == "assistant" and led.roles[-1] == "tool"
  assert all(lp == 0.0 for lp in led.logprobs)
  assert compact_renderer.tokenizer.decode(led.ids) == (
      "<|system|>S<|end|><|user|>2+3<|end|><|assistant|><answer>5</answer><|end|>"
      "<|tool|>x<|end|>"
  )


def test_rl_completion_stored_exactly(compact_renderer):
  r = compact_renderer
  led = r.render_conversation([("user", "hi")])
  prompt = r.begin_assistant(led)
  assert prompt == [USER] + _b("hi") + [END, ASST] == list(led.ids)
  before = led.ids
  sampled = _b("ok") + [END]
  text = r.append_completion(led, sampled, [-0.25, -0.5, -0.125], finished_by_stop=True)
  assert text == "ok"
  assert led.ids[: len(before)] == before
  assert list(led.ids[len(before) :]) == sampled  # compact appends nothing after the stop
  assert led.logprobs[len(before) :] == (-0.25, -0.5, -0.125)
  assert led.trainable == (False,) * len(before) + (True,) * 3
  assert set(led.turn[len(before) - 1 :]) == {1} and led.open_turn is None
  assert (r.completions_checked, r.retokenize_mismatches) == (1, 0)


def test_sft_mask_equals_rl_mask(compact_renderer):
  r = compact_renderer
  sft = r.render_conversation([("user", "q"), ("assistant", "a b")])
  rl = r.render_conversation([("user", "q")])
  r.begin_assistant(rl)
  r.append_completion(rl, r.tokenizer.encode("a b") + [END], [-1.0] * 4, True)
  assert sft.ids == rl.ids and sft.trainable == rl.trainable and sft.turn == rl.turn


def test_sampled_ids_kept_when_they_retokenise_differently(compact_renderer):
  r = compact_renderer
  led = r.render_conversation([("user", "q")])
  r.begin_assistant(led)
  n = len(led)
  # The policy spelled "<answer>" byte by byte; encode would give the single id 266.
  sampled = _b("<answer>") + _b("7") + [ANS_CLOSE, END]
  text = r.append_completion(led, sampled, [-0.5] * len(sampled), finished_by_stop=True)
  assert text == "<answer>7</answer>"
  assert list(led.ids[n:]) == sampled
  assert r.tokenizer.encode(text)[0] == ANS
  assert r.retokenize_mismatches == 1 and r.completions_checked == 1
  assert r.metrics()["text/retokenize_mismatch_rate"] == 1.0


def test_truncated_completion_closed_without_loss(compact_renderer):
  r = compact_renderer
  led = r.render_conversation([("user", "q")])
  r.begin_assistant(led)
  n = len(led)
  sampled = [0xE2, 0x82]  # cut inside '€': decodes to U+FFFD, does not round-trip
  text = r.append_completion(led, sampled, [-1.0, -2.0], finished_by_stop=False)
  assert text == "\ufffd"
  assert list(led.ids[n:]) == sampled + [END]
  assert led.trainable[n:] == (True, True, False)
  assert r.retokenize_mismatches == 1
  r.render_turn(led, "user", "next")  # the ledger is well formed again
  assert led.ids[-1] == END and led.turn[-1] == 2


def test_forked_completions_share_prompt(compact_renderer):
  r = compact_renderer
  led = r.render_conversation([("user", "q")])
  r.begin_assistant(led)
  prompt = led.ids
  kids = [led.copy() for _ in range(3)]
  for g, kid in enumerate(kids):
    r.append_completion(kid, [ord("a") + g, END], [-0.1, -0.2], True)
  assert led.ids == prompt and led.open_turn is not None
  # finished_by_stop inferred from the last id when not given.
  inferred = led.copy()
  assert r.append_completion(inferred, [ord("x"), END], [-0.1, -0.2]) == "x"
  assert inferred.ids == kids[0].ids[: len(prompt)] + (ord("x"), END)
  cut = led.copy()
  assert r.append_completion(cut, [ord("x")], [-0.1]) == "x"
  assert cut.ids[len(prompt) :] == (ord("x"), END) and cut.trainable[-1] is False
  assert [k.ids[len(prompt)] for k in kids] == [ord("a"), ord("b"), ord("c")]


def test_renderer_errors(compact_renderer):
  r = compact_renderer
  led = TokenLedger()
  with pytest.raises(
      ValueError,
      match=r"unknown chat role 'robot'; allowed roles: "
      r"\['system', 'user', 'assistant', 'tool'\]",
  ):
    r.render_turn(led, "robot", "x")
  with pytest.raises(ValueError, match="begin_assistant on this ledger first"):
    r.append_completion(led, [END], [0.0], True)
  with pytest.raises(ValueError, match="trainable=True only for role 'assistant'"):
    r.render_turn(led, "user", "x", trainable=True)
  with pytest.raises(TypeError, match="content must be str"):
    r.render_turn(led, "user")
  r.begin_assistant(led)
  with pytest.raises(ValueError, match="already open"):
    r.begin_assistant(led)
  with pytest.raises(ValueError, match="has no completion yet"):
    r.render_turn(led, "user", "x")
  with pytest.raises(ValueError, match="2 ids but 1 logprobs"):
    r.append_completion(led, [1, END], [0.0], True)
  with pytest.raises(ValueError, match="last id 97 is not a stop id"):
    r.append_completion(led, [97], [0.0], True)
  assert list(led.ids) == [ASST]  # failed calls appended nothing
  with pytest.raises(ValueError, match="needs '<\\|im_start\\|>' as a single token"):
    chatml(ByteTokenizer())
  with pytest.raises(ValueError, match="must equal"):
    ChatFormat("bad", {"assistant": (1,)}, {"assistant": (2, 3)}, stop_ids=(2,))
  with pytest.raises(ValueError, match="empty header for role 'user'"):
    ChatFormat("bad", {"assistant": (1,), "user": ()}, {"assistant": (2,), "user": (2,)}, (2,))


def test_chatml_byte_tokenizer_exact_ids():
  tok = ByteTokenizer(extra_specials=("<|im_start|>", "<|im_end|>"))
  start, end = 268, 269
  r = ChatRenderer(tok, chatml(tok))
  assert r.fmt.stop_ids == (end, EOS) and r.fmt.after_stop_ids == (ord("\n"),)
  led = r.render_conversation([("user", "hi")])
  prompt = r.begin_assistant(led)
  assert prompt == [start] + _b("user\nhi") + [end] + _b("\n") + [start] + _b("assistant\n")
  r.append_completion(led, _b("ok") + [end], [-1.0] * 3, True)
  assert tok.decode(led.ids) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
  )
  assert led.trainable[-4:] == (True, True, True, False)  # the framework's '\n' is not trained


def _hf_tokenizer(tmp_path):
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=320,
      special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  raw.train_from_iterator(
      ["hello world, the user asked", "assistant system tool"] * 4, trainer=trainer
  )
  raw.add_special_tokens(
      [
          AddedToken(t, special=True, normalized=False)
          for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
      ]
  )
  raw.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
      '{"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}'
  )
  return HFTokenizer.from_dir(str(tmp_path))


def test_chatml_hf_matches_template_string(tmp_path):
  tok = _hf_tokenizer(tmp_path)
  r = ChatRenderer(tok, chatml(tok))
  end = tok.token_to_id("<|im_end|>")
  assert r.fmt.stop_ids == (end, tok.eos_id)
  led = r.render_conversation(
      [
          ("system", "You are terse."),
          ("user", "hello world"),
          ("assistant", "hello"),
          ("user", "the tool"),
      ]
  )
  prompt = r.begin_assistant(led)
  want = (
      "<|im_start|>system\nYou are terse.<|im_end|>\n"
      "<|im_start|>user\nhello world<|im_end|>\n"
      "<|im_start|>assistant\nhello<|im_end|>\n"
      "<|im_start|>user\nthe tool<|im_end|>\n"
      "<|im_start|>assistant\n"
  )
  assert tok.decode(prompt) == want
  assert prompt == tok.encode(want)  # piecewise rendering equals tokenising the whole string
  trained = [i for i, t in zip(led.ids, led.trainable) if t]
  assert trained == tok.encode("hello") + [end]


def test_hf_sampled_ids_kept_when_they_retokenise_differently(tmp_path):
  tok = _hf_tokenizer(tmp_path)
  r = ChatRenderer(tok, chatml(tok))
  end = tok.token_to_id("<|im_end|>")
  merged = tok.encode("hello")
  spelled = [tok.token_to_id(c) for c in "hello"]  # one byte-level token per letter
  assert len(merged) < len(spelled)
  led = r.render_conversation([("user", "hi")])
  r.begin_assistant(led)
  n = len(led)
  assert r.append_completion(led, merged + [end], [-1.0] * (len(merged) + 1), True) == "hello"
  assert r.retokenize_mismatches == 0
  led2 = r.render_conversation([("user", "hi")])
  r.begin_assistant(led2)
  assert r.append_completion(led2, spelled + [end], [-1.0] * 6, True) == "hello"
  assert list(led2.ids[n : n + 6]) == spelled + [end]
  assert (r.completions_checked, r.retokenize_mismatches) == (2, 1)
