"""Text side of the agent loop: tokenizers, chat rendering into a token ledger, tool-call syntax.

Plain Python on the host (no JAX). The rollout engine renders environment
turns into a `TokenLedger` with a `ChatRenderer`, prompts the sampler with the
ledger's ids, and appends the sampled completion exactly as sampled.
"""

from mtrl_jax.text.chat import (ROLES, ChatFormat, ChatRenderer, chatml, compact, strip_thinking)
from mtrl_jax.text.ledger import TokenLedger
from mtrl_jax.text.tokenizer import DEFAULT_SPECIALS, ByteTokenizer, HFTokenizer, Tokenizer
from mtrl_jax.text.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    ToolCallError,
    extract_answer,
    parse_tool_calls,
    render_tool_call,
)

__all__ = [
    "ROLES",
    "ChatFormat",
    "ChatRenderer",
    "chatml",
    "compact",
    "strip_thinking",
    "TokenLedger",
    "DEFAULT_SPECIALS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "ToolCall",
    "ToolCallError",
    "extract_answer",
    "parse_tool_calls",
    "render_tool_call",
]
