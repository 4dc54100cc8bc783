"""Turning text into ids without ever producing a special token from user text.

Two kinds of text reach the tokenizer and they must be encoded differently:

- *template text* (the chat template's own markup, e.g. ``<|im_start|>user\\n``) is trusted:
  special tokens in it must become their ids;
- *user text* (system prompt, documents, question) is not: a document that contains the string
  ``<file_sep>`` must stay text. Otherwise a crafted document could plant an SSEP in the middle of
  itself and restart the engine's hash chain there, or close the user turn with ``<|im_end|>``.

``split_special_tokens=True`` makes a Hugging Face tokenizer treat *special* added tokens as text,
but not non-special added tokens (Qwen's FIM and tool tokens are of that kind), and a BPE could in
principle merge plain pieces into a reserved id. So every user encoding is checked against the
full reserved set; on a hit the text is re-encoded in pieces cut inside each occurrence of a
reserved token's string (separately encoded pieces cannot merge across the cut), and checked again.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from minipic.prompt_builder.errors import InvalidInputError, ReservedTokenError, SpanTokenError
from minipic.span_contract.span_config import SpanConfig
from minipic.span_contract.special_tokens import bos_prefix_ids, special_token_ids

MARKER_NAMES = ("ssep_id", "pdep_id", "pad_id")


def check_text(text: object, what: str) -> str:
    """``text`` if it is a str the tokenizer can take, else ``InvalidInputError``.

    Why: a Python str may hold lone surrogates (``"\\ud800"``, e.g. from ``json.loads`` of a
    broken escape or ``bytes.decode(errors="surrogateescape")``); it is not valid Unicode, and a
    Hugging Face fast tokenizer raises a bare ``TypeError`` on it. Named here, it is bad input
    of one question, not a crash of a whole batch.
    """
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{what} is not valid Unicode: lone surrogate {text[exc.start]!r} at position "
            f"{exc.start} (decode bytes with errors='replace' instead of 'surrogateescape')"
        ) from None
    return text


class PromptEncoder:
    """A Hugging Face tokenizer, split into trusted (template) and untrusted (user) encoding."""

    def __init__(self, tokenizer: Any, span_config: SpanConfig, cache_size: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.span_config = span_config
        self.vocab_size = len(tokenizer)
        specials = special_token_ids(tokenizer)
        self.markers = frozenset(getattr(span_config, n) for n in MARKER_NAMES)
        self._check_markers(set(specials.values()))
        self.reserved_ids = frozenset(specials.values()) | self.markers
        # strings whose occurrence in user text must be cut (one-char tokens cannot be cut)
        self._reserved_strings = tuple(
            sorted({s for s, i in specials.items() if i in self.reserved_ids and len(s) > 1})
        )
        self.bos_prefix = tuple(self._leading_special_ids())
        self._encode_user_cached = lru_cache(maxsize=cache_size)(self._encode_user)

    # -- configuration checks ------------------------------------------------------------------

    def _check_markers(self, special_ids: set[int]) -> None:
        cfg = self.span_config
        specials = {
            "bos": getattr(self.tokenizer, "bos_token_id", None),
            "eos": getattr(self.tokenizer, "eos_token_id", None),
        }
        for name in MARKER_NAMES:
            tid = getattr(cfg, name)
            if not 0 <= tid < self.vocab_size:
                raise SpanTokenError(
                    f"{name}={tid} is outside the tokenizer's vocabulary (0..{self.vocab_size - 1})"
                )
            if tid not in special_ids:
                piece = self.tokenizer.convert_ids_to_tokens(tid)
                raise SpanTokenError(
                    f"{name}={tid} ({piece!r}) is an ordinary vocabulary token: user text would "
                    "produce it. Choose an unused special token"
                )
            for role, sid in specials.items():
                if sid is not None and tid == sid:
                    raise SpanTokenError(
                        f"{name}={tid} is the tokenizer's {role} token; markers must be tokens "
                        "the model and the chat template never use"
                    )

    def _leading_special_ids(self) -> list[int]:
        """Ids the tokenizer puts before text by default (BOS for Llama-style tokenizers).

        Why ``span_contract``'s function: for a model without a chat template this is also the
        sink (``model_sink_ids``), which the engine computes too; one definition keeps a plain
        prompt's opening and its spans' sinks the same ids.
        """
        return list(bos_prefix_ids(self.tokenizer))

    # -- encoding ------------------------------------------------------------------------------

    def _call(self, text: str, *, add_special_tokens: bool, split: bool) -> list[int]:
        out = self.tokenizer(
            text, add_special_tokens=add_special_tokens, split_special_tokens=split
        )
        return list(out["input_ids"])

    def encode_template(self, text: str) -> list[int]:
        """Trusted text: special tokens in it become their ids."""
        if not text:
            return []
        return self._call(text, add_special_tokens=False, split=False)

    def encode_user(self, text: str, what: str = "text") -> list[int]:
        """Untrusted text: never contains a reserved id (raises ``ReservedTokenError`` if the
        tokenizer cannot encode it otherwise)."""
        check_text(text, what)
        if not text:
            return []
        return list(self._encode_user_cached(text))

    def _encode_user(self, text: str) -> tuple[int, ...]:
        ids = self._call(text, add_special_tokens=False, split=True)
        if self.reserved_ids.isdisjoint(ids):
            return tuple(ids)
        ids = []
        for piece in self._cut_reserved(text):
            ids.extend(self._call(piece, add_special_tokens=False, split=True))
        leaked = sorted(self.reserved_ids.intersection(ids))
        if leaked:
            raise ReservedTokenError(
                f"the tokenizer turns this text into reserved id(s) {leaked} even when encoded "
                "piecewise; remove those strings from the text"
            )
        return tuple(ids)

    def _cut_reserved(self, text: str) -> list[str]:
        """Split ``text`` one character into every occurrence of a reserved token's string."""
        cuts = set()
        for token in self._reserved_strings:
            start = text.find(token)
            while start != -1:
                cuts.add(start + 1)
                start = text.find(token, start + 1)
        bounds = [0, *sorted(cuts), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def check_user_ids(self, ids: Sequence[object], what: str) -> tuple[int, ...]:
        """Pre-tokenised user ids: ints in the vocabulary, none of them reserved."""
        out = []
        for pos, tid in enumerate(ids):
            if isinstance(tid, bool) or not isinstance(tid, int):
                raise InvalidInputError(f"{what}: token {pos} is {tid!r}, not an int")
            if not 0 <= tid < self.vocab_size:
                raise InvalidInputError(
                    f"{what}: token {pos} = {tid} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )
            out.append(tid)
        leaked = sorted(self.reserved_ids.intersection(out))
        if leaked:
            raise ReservedTokenError(
                f"{what} contains reserved special id(s) {leaked}; special ids are placed by the "
                "builder only"
            )
        return tuple(out)

    def decode(self, ids: Sequence[int]) -> str:
        """Exact decode (no clean-up of spaces): what the model sees, as text."""
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
