"""Counting tokens with whatever tokenizer is at hand.

Why a protocol: budgeting often happens before the model's tokenizer is known or loaded (a
retriever sizing documents for an OpenAI-compatible endpoint, an orchestrator planning ahead), and
tiktoken is the usual counter there. The builder itself always lays out with the model's own
tokenizer; these counters only estimate. Both adapters count special-token strings in the text as
plain text, as the builder encodes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from minipic.prompt_builder.errors import InvalidInputError


@runtime_checkable
class TokenCounter(Protocol):
    """Anything that can encode text to ids and decode ids back (for truncation)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenCounter:
    """A Hugging Face tokenizer as a ``TokenCounter`` (no BOS/EOS, special strings as text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        out = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(out["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


class TiktokenCounter:
    """A ``tiktoken.Encoding`` as a ``TokenCounter`` (``encode_ordinary``: no special tokens)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")


def as_token_counter(counter: Any) -> TokenCounter:
    """Wrap a tiktoken encoding (or its name), an HF tokenizer, or pass a TokenCounter through."""
    if isinstance(counter, str):
        from minipic.span_contract.tiktoken_offline import get_encoding

        return TiktokenCounter(get_encoding(counter))
    if hasattr(counter, "encode_ordinary"):
        return TiktokenCounter(counter)
    if hasattr(counter, "added_tokens_decoder") or hasattr(counter, "apply_chat_template"):
        return HFTokenCounter(counter)
    if isinstance(counter, TokenCounter):
        return counter
    raise InvalidInputError(
        f"cannot count tokens with {type(counter).__name__}: pass a tiktoken Encoding or its "
        "name, a Hugging Face tokenizer, or an object with encode(text) and decode(ids)"
    )


def count_tokens(counter: Any, text: str) -> int:
    return len(as_token_counter(counter).encode(text))


def truncate_text(counter: TokenCounter, text: str, max_tokens: int) -> str:
    """The longest prefix of ``text`` whose tokens are the first ``max_tokens`` of ``text``'s.

    Decoding a cut token sequence can end inside a character (tiktoken, byte-level BPE); the
    result is trimmed back to a true prefix of the input so no replacement character leaks in.
    """
    ids = counter.encode(text)
    if len(ids) <= max_tokens:
        return text
    out = counter.decode(ids[:max_tokens]).rstrip("\ufffd")
    if text.startswith(out):
        return out
    return os.path.commonprefix([out, text])  # a tokenizer whose decode is not exact
