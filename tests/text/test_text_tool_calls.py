"""Tool-call syntax: render/parse round trip, one test per malformed case, answer tags."""

import pytest

from mtrl_jax.text import (
    ToolCall,
    ToolCallError,
    extract_answer,
    parse_tool_calls,
    render_tool_call,
)


def test_render_is_compact_json():
  assert render_tool_call("calc", {"expr": "2+3"}) == (
      '<tool_call>{"name":"calc","arguments":{"expr":"2+3"}}</tool_call>'
  )
  assert render_tool_call("now", {}) == '<tool_call>{"name":"now","arguments":{}}</tool_call>'
  assert render_tool_call("say", {"t": "ü"}) == (
      '<tool_call>{"name":"say","arguments":{"t":"ü"}}</tool_call>'
  )


def test_round_trip_several_calls():
  args1 = {"expr": "2*(3+4)", "nested": {"a": [1, 2.5, None, True]}, "s": '数 "q" </x>'}
  raw1, raw2 = render_tool_call("calc", args1), render_tool_call("search", {"q": "jax"})
  text = f"Let me compute. {raw1} and then {raw2} done"
  calls = parse_tool_calls(text)
  assert calls == [ToolCall("calc", args1, raw1), ToolCall("search", {"q": "jax"}, raw2)]
  assert parse_tool_calls("no calls here") == []


def test_whitespace_inside_tags_is_accepted():
  text = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
  assert parse_tool_calls(text) == [ToolCall("calc", {"x": 1}, text)]


OPEN, CLOSE = "<tool_call>", "</tool_call>"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            OPEN + '{"name":"a","arguments":{}}',
            r"tool call #1: unclosed tag: <tool_call> at char 0 has no </tool_call>",
        ),
        # 11 chars of '<tool_call>' + 11 of '{"name":"a"' put the second tag at char 22.
        (
            OPEN + '{"name":"a"' + OPEN + "{}" + CLOSE,
            r"tool call #1: <tool_call> at char 0 is not closed before the next <tool_call> at char 22",
        ),
        ("x" + CLOSE, r"</tool_call> at char 1 has no matching <tool_call>"),
        (OPEN + " \n" + CLOSE, r"tool call #1: empty body"),
        # Hand-counted: in '{"name":"a" "arguments":{}}' '{'=0, '"name"'=1..6, ':'=7, '"a"'=8..10,
        # ' '=11, so the '"' where a ',' should be is at index 12 (column 13).
        (
            OPEN + '{"name":"a" "arguments":{}}' + CLOSE,
            r"tool call #1: invalid JSON at position 12 \(line 1, column 13\): Expecting ',' delimiter",
        ),
        (OPEN + '["a", {}]' + CLOSE, r"tool call #1: JSON must be an object .*got list"),
        (OPEN + '{"arguments":{}}' + CLOSE, r'tool call #1: missing "name"'),
        (OPEN + '{"name":3,"arguments":{}}' + CLOSE, r'"name" must be a non-empty string, got 3'),
        (OPEN + '{"name":"a"}' + CLOSE, r'tool call #1: missing "arguments"'),
        (
            OPEN + '{"name":"a","arguments":"{\\"x\\":1}"}' + CLOSE,
            r'"arguments" must be a JSON object, got str',
        ),
        (OPEN + '{"name":"a","arguments":{},"id":1}' + CLOSE, r"unexpected keys \['id'\]"),
    ],
)
def test_malformed_calls_say_what_is_wrong(text, message):
  with pytest.raises(ToolCallError, match=message):
    parse_tool_calls(text)


def test_error_names_the_bad_call():
  good = render_tool_call("a", {})
  with pytest.raises(ToolCallError, match=r'tool call #2: missing "name"'):
    parse_tool_calls(good + '<tool_call>{"arguments":{}}</tool_call>')


def test_render_rejects_bad_input():
  with pytest.raises(ValueError, match="name must be a non-empty string"):
    render_tool_call("", {})
  with pytest.raises(ValueError, match="arguments must be a dict, got list"):
    render_tool_call("a", [1])


def test_extract_answer():
  assert extract_answer("so <answer> 42 </answer>") == "42"
  assert extract_answer("<answer>1</answer> no, <answer>2</answer>") == "2"  # the last one
  assert extract_answer("<answer>a\nb</answer>") == "a\nb"
  assert extract_answer("<answer>x<answer>y</answer>") == "y"
  assert extract_answer("<answer>unclosed") is None
  assert extract_answer("nothing") is None
  assert extract_answer("<final>ok</final>", tag="final") == "ok"
