"""Chat templates around block-aligned spans.

A chat template renders a whole conversation to one string, which would then be tokenized in one
go — spans would land wherever the template's text leaves them. Instead we render the template
once with *slots* (private-use placeholder strings) in place of the system prompt and the user
content, cut the rendering at the slots, and encode each piece on its own:

    <template head> [system] <template text> [spans] <template text> [question] <template tail>
    |------------ system span --------------|         |------------ question ---------------|

The template's own text is encoded as trusted text (its special tokens become ids); the system
prompt, spans and question as untrusted user text. The system prompt together with the template
head and the user-turn header forms the system span (a cacheable prefix at offset 0); the text
between spans and question, the question and the template's tail (end of turn, assistant header)
form the question suffix. Spans sit in between, each free to start on a block boundary.

Templates that put the system prompt inside the first user turn (Gemma) or just before the last
one (Mistral) still render ``system < spans < question`` and work the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minipic.prompt_builder.encoding import PromptEncoder
from minipic.prompt_builder.errors import ChatTemplateError, SpanTokenError

SYSTEM_SLOT = "\ue000minipic-system\ue000"
SPANS_SLOT = "\ue000minipic-spans\ue000"
QUESTION_SLOT = "\ue000minipic-question\ue000"


@dataclass(frozen=True)
class PromptFrame:
    """Token pieces around the spans: the system span, and what wraps the question."""

    system: tuple[int, ...]
    before_question: tuple[int, ...]
    after_question: tuple[int, ...]


def plain_frame(encoder: PromptEncoder, system: str | None) -> PromptFrame:
    """No template: BOS (if the tokenizer adds one) + system prompt; the question is bare."""
    ids = list(encoder.bos_prefix)
    if system:
        ids.extend(encoder.encode_user(system, "system"))
    return PromptFrame(tuple(ids), (), ())


def render_with_slots(
    tokenizer: Any, system: str | None, template_kwargs: Mapping[str, Any]
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; build with "
            "chat_template=False"
        )
    messages = [{"role": "user", "content": SPANS_SLOT + QUESTION_SLOT}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": SYSTEM_SLOT})
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(template_kwargs)
        )
    except Exception as exc:  # jinja raises anything a template author wrote
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    if not isinstance(rendered, str):
        raise ChatTemplateError(f"chat template rendered {type(rendered).__name__}, not str")
    return rendered


def split_at_slots(rendered: str, slots: list[str]) -> list[str]:
    """``rendered`` cut at each slot, which must each appear once, in the given order."""
    pieces, rest = [], rendered
    for slot in slots:
        count = rendered.count(slot)
        if count != 1:
            raise ChatTemplateError(
                f"chat template rendered the {slot.strip(chr(0xE000))} slot {count} times "
                "(expected once); it rewrites or repeats message content"
            )
        head, sep, rest = rest.partition(slot)
        if not sep:
            raise ChatTemplateError(
                "chat template does not render system prompt, documents and question in that "
                "order; the system prompt cannot be a prefix span"
            )
        pieces.append(head)
    pieces.append(rest)
    return pieces


def chat_frame(
    encoder: PromptEncoder, system: str | None, template_kwargs: Mapping[str, Any]
) -> PromptFrame:
    rendered = render_with_slots(encoder.tokenizer, system, template_kwargs)
    if system is None:
        head, between, tail = split_at_slots(rendered, [SPANS_SLOT, QUESTION_SLOT])
        system_ids = encoder.encode_template(head)
    else:
        head, mid, between, tail = split_at_slots(
            rendered, [SYSTEM_SLOT, SPANS_SLOT, QUESTION_SLOT]
        )
        system_ids = (
            encoder.encode_template(head)
            + encoder.encode_user(system, "system")
            + encoder.encode_template(mid)
        )
    frame = PromptFrame(
        system=tuple(system_ids),
        before_question=tuple(encoder.encode_template(between)),
        after_question=tuple(encoder.encode_template(tail)),
    )
    clash = encoder.markers.intersection(
        frame.system + frame.before_question + frame.after_question
    )
    if clash:
        raise SpanTokenError(
            f"the chat template itself emits marker id(s) {sorted(clash)}; choose SSEP/PDEP/PAD "
            "ids the template never uses"
        )
    return frame
