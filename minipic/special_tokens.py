"""Default SSEP / PDEP / PAD tokens per model family.

Why real vocabulary ids: the engine sees token ids only, so the markers must be ids the model
already has and that encoding user text never yields. Each family ships a few special tokens it
never uses in chat (Llama-3's reserved tokens, StarCoder-style code markers in SmolLM2, ...). We
pick three of those per family; anything else must be configured explicitly.
"""

from __future__ import annotations

from typing import Any

from minipic.span_config import SpanConfig

# family name -> (ssep, pdep, pad) token strings, tried in order; the first family whose three
# tokens all exist as single special ids in the tokenizer wins.
FAMILY_TOKENS: dict[str, tuple[str, str, str]] = {
    "llama3": (
        "<|reserved_special_token_10|>",
        "<|reserved_special_token_11|>",
        "<|reserved_special_token_12|>",
    ),
    "smollm2": ("<file_sep>", "<jupyter_start>", "<empty_output>"),
    "qwen2": ("<|box_start|>", "<|box_end|>", "<|fim_pad|>"),
    "mistral": ("[control_10]", "[control_11]", "[control_12]"),
}


class NoSpanTokensError(ValueError):
    """The tokenizer has no known unused special tokens; pass ssep/pdep/pad ids explicitly."""


def _special_id(tokenizer: Any, token: str) -> int | None:
    vocab = tokenizer.get_vocab()
    tid = vocab.get(token)
    if tid is None:
        return None
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if tid in specials or tid in added:
        return int(tid)
    return None


def detect_family(tokenizer: Any) -> str | None:
    for family, tokens in FAMILY_TOKENS.items():
        if all(_special_id(tokenizer, t) is not None for t in tokens):
            return family
    return None


def default_span_config(tokenizer: Any, block_size: int = 32) -> SpanConfig:
    """SpanConfig for a tokenizer of a known family, or a clear error naming what to pass."""
    family = detect_family(tokenizer)
    if family is None:
        raise NoSpanTokensError(
            f"no known unused special tokens in tokenizer {type(tokenizer).__name__} "
            f"(known families: {', '.join(FAMILY_TOKENS)}); pass ssep_id, pdep_id and pad_id "
            "explicitly"
        )
    ssep, pdep, pad = (_special_id(tokenizer, t) for t in FAMILY_TOKENS[family])
    return SpanConfig(block_size=block_size, ssep_id=ssep, pdep_id=pdep, pad_id=pad)


def span_config_for_model(model_dir: str, block_size: int = 32) -> SpanConfig:
    from transformers import AutoTokenizer

    return default_span_config(AutoTokenizer.from_pretrained(model_dir), block_size)
