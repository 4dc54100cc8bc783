"""``PromptBuilder``: system prompt + spans + question -> span-aware token ids and a layout.

The builder is the client half of the contract in ``span_contract.span_config``: it places
SSEP / PDEP / PAD exactly where the engine's block hasher expects them (block starts) and reports,
for the orchestrator, which prefill requests warm which blocks and how many prompt tokens the engine
should then find cached. Which tokens go where is decided by the mode (``prompt_builder.modes``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError as PydanticValidationError

from minipic.prompt_builder.budget import (
    BudgetPolicy,
    BudgetReport,
    DroppedSpan,
    TruncatedSpan,
    allocate,
    coerce_policy,
)
from minipic.prompt_builder.chat import PromptFrame, chat_frame, plain_frame
from minipic.prompt_builder.counting import HFTokenCounter, TokenCounter
from minipic.prompt_builder.encoding import PromptEncoder
from minipic.prompt_builder.errors import (
    BlockSizeError,
    EngineMismatchError,
    InvalidInputError,
    MissingSpanTokensError,
    PromptTooLongError,
    SpanTokenError,
    SpanTooLongError,
)
from minipic.prompt_builder.layout import (
    Segment,
    blocks_for,
    expected_cached_tokens,
    prefill_regions,
    reusable_block_mask,
    reusable_tokens,
)
from minipic.prompt_builder.modes import Layout, Mode, PromptParts, make_layout, parse_mode
from minipic.prompt_builder.result import BuiltPrompt, SkippedSpan, SpanInfo
from minipic.prompt_builder.spans import (
    PreparedSpan,
    Span,
    check_distinct_ids,
    coerce_spans,
    content_id,
    prefill_key,
    require_tokens,
)
from minipic.span_contract.span_config import SpanConfig
from minipic.span_contract.special_tokens import (
    FAMILY_TOKENS,
    NoSpanTokensError,
    default_span_config,
    family_span_config,
    model_sink_ids,
)


def _check_block_size(block_size: object, multiple: int | None) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise BlockSizeError(f"block_size must be a positive int, got {block_size!r}")
    if multiple is not None:
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise BlockSizeError(f"block_size_multiple must be a positive int, got {multiple!r}")
        if block_size % multiple:
            raise BlockSizeError(
                f"block_size {block_size} is not a multiple of {multiple}, which the engine "
                "requires (vLLM's CPU attention backend: 32)"
            )
    return block_size


def _model_max_len(model_dir: str | os.PathLike[str]) -> int | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


class PromptBuilder:
    """Builds span-aware prompts for one tokenizer and one ``SpanConfig``.

    ``chat_template``: wrap system prompt, spans and question in the tokenizer's chat template
    (spans stay block-aligned inside it); ``False`` for plain concatenation (BOS + system, spans,
    question). ``max_model_len``: the engine's context limit; prompts are budgeted against it.
    ``block_size_multiple``: what the engine requires of the block size (vLLM CPU: 32).
    """

    def __init__(
        self,
        tokenizer: Any,
        span_config: SpanConfig,
        *,
        chat_template: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_model_len: int | None = None,
        block_size_multiple: int | None = None,
    ) -> None:
        if not isinstance(span_config, SpanConfig):
            raise InvalidInputError(
                f"span_config must be a SpanConfig, got {type(span_config).__name__}"
            )
        _check_block_size(span_config.block_size, block_size_multiple)
        if not (callable(tokenizer) and hasattr(tokenizer, "convert_ids_to_tokens")):
            raise InvalidInputError(
                f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__} "
                "(tiktoken encodings can count and budget: see fit_texts)"
            )
        if max_model_len is not None and (
            isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
            or max_model_len < 1
        ):
            raise InvalidInputError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.span_config = span_config
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer, span_config)
        self.chat_template = bool(chat_template)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_model_len = max_model_len
        self._frame = lru_cache(maxsize=256)(self._make_frame)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str] | None = None,
        block_size: int = 32,
        ssep_id: int | None = None,
        pdep_id: int | None = None,
        pad_id: int | None = None,
        *,
        family: str | None = None,
        chat_template: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_model_len: int | Literal["auto"] | None = "auto",
        block_size_multiple: int | None = None,
        sink_ids: Sequence[int] | None = None,
        sink_gap: int | None = None,
    ) -> PromptBuilder:
        """Load the tokenizer of ``model_dir`` (None: minipic's default model) and pick markers.

        ``sink_ids``: the opening copied after each span's SSEP (None: the model's own,
        ``span_contract.special_tokens.model_sink_ids``, the one the engine computes, whatever
        ``chat_template`` and ``chat_template_kwargs`` say; ``()``: spans without a sink).
        ``sink_gap``: the engine's ``SpanConfig.sink_gap`` (None: the one the model folder was
        tuned for, ``span_contract.models.tuned_sink_gap``, as the engine's default). Positions
        only: the builder lays out the same tokens whatever it is; it is part of the
        configuration it checks against the engine's.
        Marker ids default to the model family's unused special tokens
        (``span_contract.special_tokens``; ``family`` forces one); any id given explicitly overrides
        its default. ``max_model_len="auto"`` reads ``max_position_embeddings`` from the
        model's config.json (None: no limit).
        """
        from transformers import AutoTokenizer

        from minipic.span_contract.models import resolve_model, tuned_sink_gap

        _check_block_size(block_size, block_size_multiple)
        path = resolve_model(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if sink_gap is None:
            sink_gap = tuned_sink_gap(path)
        config = cls._pick_span_config(tokenizer, block_size, family, ssep_id, pdep_id, pad_id,
                                       sink_ids, sink_gap)
        if max_model_len == "auto":
            max_model_len = _model_max_len(path)
        return cls(
            tokenizer, config, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs, max_model_len=max_model_len,
            block_size_multiple=block_size_multiple,
        )

    @staticmethod
    def _pick_span_config(
        tokenizer: Any, block_size: int, family: str | None,
        ssep_id: int | None, pdep_id: int | None, pad_id: int | None,
        sink_ids: Sequence[int] | None = None, sink_gap: int = 0,
    ) -> SpanConfig:
        given = {"ssep_id": ssep_id, "pdep_id": pdep_id, "pad_id": pad_id}
        defaults: dict[str, int] = {}
        try:
            if family is not None:
                defaults = family_span_config(tokenizer, family, block_size).model_dump()
            elif None in given.values():
                defaults = default_span_config(tokenizer, block_size).model_dump()
        except NoSpanTokensError as exc:
            missing = [k for k, v in given.items() if v is None]
            raise MissingSpanTokensError(
                f"{exc}. Missing: {', '.join(missing)} (known families: "
                f"{', '.join(FAMILY_TOKENS)})"
            ) from None
        ids = {k: (v if v is not None else defaults[k]) for k, v in given.items()}
        sink = model_sink_ids(tokenizer) if sink_ids is None else tuple(sink_ids)
        for name, tid in ids.items():
            if tid in sink:
                piece = tokenizer.convert_ids_to_tokens(tid)
                raise SpanTokenError(
                    f"{name}={tid} ({piece!r}) is a token of the model's opening, which every "
                    "span carries as its sink; markers must be tokens the chat template never "
                    "writes")
        try:
            return SpanConfig(block_size=block_size, sink_ids=sink, sink_gap=sink_gap, **ids)
        except PydanticValidationError as exc:
            raise SpanTokenError(f"invalid span token ids {ids}: {exc}") from None

    # -- helpers for callers --------------------------------------------------------------------

    def without_sink(self) -> PromptBuilder:
        """This builder with spans that carry no sink (``SpanConfig.sink_ids`` empty): what
        the layout costs without it, in tokens and in fidelity. Any engine accepts such
        spans; it simply finds no sink in them."""
        cached = getattr(self, "_without_sink", None)
        if cached is None:
            config = self.span_config.model_copy(update={"sink_ids": ()})
            cached = PromptBuilder(self.tokenizer, config, chat_template=self.chat_template,
                                   chat_template_kwargs=self.chat_template_kwargs,
                                   max_model_len=self.max_model_len)
            self._without_sink = cached
        return cached

    @property
    def counter(self) -> TokenCounter:
        """This builder's tokenizer as a ``TokenCounter`` (for ``fit_texts`` and the like)."""
        return HFTokenCounter(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """User text to ids, as spans are encoded (never yields a special id)."""
        return self.encoder.encode_user(text)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoder.decode(ids)

    def prepare_span(self, span: Span | str, index: int = 0) -> PreparedSpan:
        """A span's final token ids and ids (content address), as ``build`` computes them."""
        return self._prepare(coerce_spans([span])[0], index)

    def check_engine(
        self, engine: SpanConfig | Mapping[str, Any] | None = None, *, block_size: int | None = None
    ) -> None:
        """Raise ``EngineMismatchError`` unless the engine runs this builder's SpanConfig.

        ``engine``: the engine's SpanConfig, or its JSON form (``GET /minipic/config``); None
        reads the plugin configuration from this process's environment. ``block_size`` alone
        checks just the engine's block size.
        """
        ours = self.span_config
        if block_size is not None and engine is None:
            if block_size != ours.block_size:
                raise EngineMismatchError(
                    f"block_size: builder {ours.block_size}, engine {block_size}; spans would "
                    "not start on the engine's block boundaries"
                )
            return
        if engine is None:
            engine = SpanConfig.from_env()
            if engine is None:
                raise EngineMismatchError(
                    "no engine configuration given and the minipic plugin is not enabled in "
                    "this process's environment"
                )
        if not isinstance(engine, SpanConfig):
            try:
                engine = SpanConfig.model_validate(dict(engine))
            except (PydanticValidationError, TypeError, ValueError) as exc:
                raise EngineMismatchError(
                    f"engine configuration is not a SpanConfig: {exc}"
                ) from None
        # a builder without a sink suits any engine: its spans simply carry none (so neither
        # the engine's sink nor where it places one matters)
        fields = [f for f in SpanConfig.model_fields
                  if f not in ("sink_ids", "sink_gap") or ours.sink_ids]
        diffs = [
            f"{field}: builder {getattr(ours, field)}, engine {getattr(engine, field)}"
            for field in fields
            if getattr(ours, field) != getattr(engine, field)
        ]
        if block_size is not None and block_size != engine.block_size:
            diffs.append(f"block_size: engine config {engine.block_size}, given {block_size}")
        if diffs:
            raise EngineMismatchError("engine runs another span configuration: " + "; ".join(diffs))

    # -- building -------------------------------------------------------------------------------

    def _make_frame(self, system: str | None, chat: bool) -> PromptFrame:
        if chat:
            return chat_frame(self.encoder, system, self.chat_template_kwargs)
        return plain_frame(self.encoder, system)

    def _prepare(self, span: Span, index: int) -> PreparedSpan:
        what = f"span {index}" + (f" ({span.id!r})" if span.id else "")
        if span.text is not None:
            ids = tuple(self.encoder.encode_user(span.text, what))
        else:
            ids = self.encoder.check_user_ids(span.token_ids or (), what)
        require_tokens(ids, index, span.id)
        return self._prepared(ids, index, span)

    def _prepared(self, ids: tuple[int, ...], index: int, span: Span) -> PreparedSpan:
        cid = content_id(ids, self.span_config)
        return PreparedSpan(
            index=index, token_ids=ids, span_id=span.id or cid, content_id=cid,
            user_id=span.id, score=span.score,
        )

    def _prepare_or_skip(self, span: Span, index: int) -> PreparedSpan | SkippedSpan:
        """A text span with no content is skipped (``SkippedSpan`` says why); pre-tokenised ids
        must not be empty (``EmptySpanError``: an empty id list is the caller's own bug)."""
        if span.text is None:
            return self._prepare(span, index)
        what = f"span {index}" + (f" ({span.id!r})" if span.id else "")
        text = span.text
        ids = tuple(self.encoder.encode_user(text, what))  # checks the text first
        if not text.strip():
            return SkippedSpan(index=index, span_id=span.id,
                               reason="empty" if not text else "whitespace only")
        if not ids:
            return SkippedSpan(index=index, span_id=span.id, reason="no tokens")
        return self._prepared(ids, index, span)

    def _question_ids(self, question: object) -> list[int]:
        """The question's own ids. Blank, or dropped entirely by the tokenizer, it is an error:
        unlike a document it cannot be left out (one rule for both: no content, no use)."""
        if not isinstance(question, str):
            raise InvalidInputError(f"question must be a str, got {type(question).__name__}")
        ids = self.encoder.encode_user(question, "question")
        if not question.strip():
            raise InvalidInputError("question is empty" + (" (whitespace only)" if question
                                                           else ""))
        if not ids:
            raise InvalidInputError("question is empty: the tokenizer drops every character "
                                    "of it")
        return ids

    def build(
        self,
        *,
        question: str,
        system: str | None = None,
        spans: Sequence[Span | str | Mapping[str, Any]] = (),
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        recompute_tokens: int | None = None,
        max_model_len: int | None = None,
        max_tokens: int = 1,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        chat_template: bool | None = None,
    ) -> BuiltPrompt:
        """Lay out one prompt.

        ``spans`` in rank order (best first) unless they carry scores. ``mode``: see
        ``prompt_builder.modes``, as a ``Mode``, ``ModeSpec`` or text (``selective@0.15``,
        ``boundary_recompute@40``); ``recompute_tokens`` is the same as ``boundary_recompute@N``.
        ``max_model_len`` (default: the builder's) with ``max_tokens`` reserved for generation
        bounds the prompt; ``budget`` says what to do when spans do not fit (``error``, ``drop``,
        ``truncate``, ``skip``; see ``prompt_builder.budget``). The result never exceeds the
        limit silently: it raises, or reports what was dropped or truncated.
        """
        spec = parse_mode(mode)
        layout = make_layout(spec, self.span_config, recompute_tokens)
        policy = coerce_policy(budget)
        question_own = self._question_ids(question)
        if system is not None and not isinstance(system, str):
            raise InvalidInputError(f"system must be a str or None, got {type(system).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidInputError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        limit = self.max_model_len if max_model_len is None else max_model_len
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise InvalidInputError(f"max_model_len must be a positive int, got {limit!r}")

        outcome = [self._prepare_or_skip(s, i) for i, s in enumerate(coerce_spans(spans))]
        prepared = [p for p in outcome if isinstance(p, PreparedSpan)]
        skipped = [p for p in outcome if isinstance(p, SkippedSpan)]
        check_distinct_ids(prepared)
        chat = self.chat_template if chat_template is None else bool(chat_template)
        frame = self._frame(system, chat)
        question_ids = [
            *frame.before_question,
            *question_own,
            *frame.after_question,
        ]
        report = None
        if limit is not None:
            prepared, report = self._fit(
                prepared, layout, frame, question_ids, limit, max_tokens, policy
            )

        system_id = content_id(frame.system, self.span_config) if frame.system else None
        parts = PromptParts(frame.system, system_id, prepared, question_ids)
        out = layout.writer()
        layout.write(out, parts)
        tokens, segments = out.tokens, out.segments
        self._verify_markers(tokens, segments)
        if limit is not None and len(tokens) + max_tokens > limit:  # a layout/cost bug
            raise PromptTooLongError(
                f"prompt of {len(tokens)} tokens + max_tokens {max_tokens} exceeds {limit}"
            )
        built = self._assemble(layout.mode, tokens, segments, prepared, report)
        text = str(spec) if recompute_tokens is None else f"{spec.mode.value}@{recompute_tokens}"
        return built.model_copy(update={"mode_spec": text, "skipped_spans": skipped})

    def _fit(
        self,
        spans: list[PreparedSpan],
        layout: Layout,
        frame: PromptFrame,
        question_ids: list[int],
        limit: int,
        max_tokens: int,
        policy: BudgetPolicy,
    ) -> tuple[list[PreparedSpan], BudgetReport]:
        fixed = layout.system_cost(len(frame.system)) + layout.question_cost(len(question_ids))
        room = limit - max_tokens - fixed
        if room < 0:
            raise PromptTooLongError(
                f"system span and question take {fixed} tokens and max_tokens reserves "
                f"{max_tokens}: over max_model_len {limit} before any span"
            )
        sizes = [len(s.token_ids) for s in spans]
        if policy is BudgetPolicy.ERROR:
            for span, n in zip(spans, sizes, strict=True):
                if layout.span_cost(n) > room:
                    raise SpanTooLongError(
                        f"span {span.index} ({span.span_id}) needs {layout.span_cost(n)} tokens "
                        f"laid out ({n} of its own) but only {room} of max_model_len {limit} are "
                        f"left after the system span, question and max_tokens {max_tokens}"
                    )
            total = sum(layout.span_cost(n) for n in sizes)
            if total > room:
                raise PromptTooLongError(
                    f"spans need {total} tokens laid out but only {room} of max_model_len "
                    f"{limit} are left; pass budget='drop', 'truncate' or 'skip' to shrink them"
                )
        scores = [s.score for s in spans]
        alloc = allocate(sizes, room, layout.span_cost, policy, scores)
        kept: list[PreparedSpan] = []
        truncated: list[TruncatedSpan] = []
        # alloc is keyed by position in ``spans``, which differs from the caller's index once a
        # span was skipped
        for pos, span in enumerate(spans):
            if pos not in alloc.kept:
                continue
            keep = alloc.kept[pos]
            if keep < len(span.token_ids):
                short = span.truncated(keep, self.span_config)
                truncated.append(TruncatedSpan(
                    index=span.index, span_id=span.span_id, new_span_id=short.span_id,
                    original_tokens=len(span.token_ids), kept_tokens=keep,
                ))
                span = short
            kept.append(span)
        dropped = [
            DroppedSpan(
                index=spans[i].index, span_id=spans[i].span_id, tokens=sizes[i],
                reason="longer than the room max_model_len leaves"
                if layout.span_cost(sizes[i]) > room else "no room left",
            )
            for i in alloc.dropped
        ]
        report = BudgetReport(
            policy=policy, limit=limit, reserved_for_generation=max_tokens, fixed_tokens=fixed,
            used_tokens=fixed + alloc.used, kept=[s.index for s in kept], dropped=dropped,
            truncated=truncated,
        )
        return kept, report

    def _verify_markers(self, tokens: list[int], segments: list[Segment]) -> None:
        """Special ids only where the layout put them (a last guard; inputs were checked)."""
        cfg = self.span_config
        expected: dict[int, int] = {}
        for seg in segments:
            if seg.marker is not None:
                expected[seg.start] = cfg.ssep_id if seg.marker == "ssep" else cfg.pdep_id
            if seg.kind == "pad":
                expected.update(dict.fromkeys(range(seg.start, seg.end), cfg.pad_id))
        markers = self.encoder.markers
        for pos, tid in enumerate(tokens):
            if (tid in markers or pos in expected) and expected.get(pos) != tid:
                raise SpanTokenError(f"marker id {tid} at position {pos} was not placed there")

    def _assemble(
        self,
        mode: Mode,
        tokens: list[int],
        segments: list[Segment],
        spans: list[PreparedSpan],
        report: BudgetReport | None,
    ) -> BuiltPrompt:
        bs = self.span_config.block_size
        prefills: list[list[int]] = []
        keys: list[str] = []
        prefill_of: dict[tuple[str, int | None], int] = {}  # (kind, span index) -> prefill
        for region in prefill_regions(segments, bs):
            ids = tokens[region.start : region.end]
            key = prefill_key(ids, bs)
            if key not in keys:  # a span repeated in one prompt is warmed once
                keys.append(key)
                prefills.append(ids)
            prefill_of[(region.kind, region.span_index)] = keys.index(key)
        infos = self._span_infos(tokens, segments, spans, prefill_of, keys)
        return BuiltPrompt(
            mode=mode, span_config=self.span_config, prompt_token_ids=tokens,
            span_prefills=prefills, prefill_keys=keys, segments=segments, spans=infos,
            expected_cached_tokens=reusable_tokens(segments, len(tokens), bs),
            leading_cached_tokens=expected_cached_tokens(segments, len(tokens), bs),
            reusable_tokens=reusable_tokens(segments, len(tokens), bs),
            budget=report,
        )

    def _span_infos(
        self,
        tokens: list[int],
        segments: list[Segment],
        spans: list[PreparedSpan],
        prefill_of: dict[tuple[str, int | None], int],
        keys: list[str],
    ) -> list[SpanInfo]:
        """One SpanInfo per span occurrence (its segments: content, head/body, padding)."""
        bs = self.span_config.block_size
        mask = reusable_block_mask(segments, len(tokens), bs)
        by_index = {s.index: s for s in spans}
        owners: dict[tuple[str, int | None], list[Segment]] = {}
        for seg in segments:
            if seg.kind == "system" or (seg.kind == "pad" and seg.reuse == "prefix"):
                owners.setdefault(("system", None), []).append(seg)
            elif seg.span_index is not None:
                owners.setdefault(("span", seg.span_index), []).append(seg)
        infos = []
        for (kind, index), segs in owners.items():
            start, end = segs[0].start, segs[-1].end
            whole_blocks = range(-(-start // bs), min(end // bs, len(mask)))
            if kind == "system":
                span_id = content = segs[0].span_id or ""
                count, truncated_from = segs[0].length, None
            else:
                prepared = by_index[index]
                span_id, content = prepared.span_id, prepared.content_id
                count, truncated_from = len(prepared.token_ids), prepared.truncated_from
            pi = prefill_of.get((kind, index))
            infos.append(SpanInfo(
                kind=kind, span_id=span_id, content_id=content, index=index, start=start,
                end=end, token_count=count, block_count=blocks_for(end - start, bs),
                reused_block_count=sum(mask[b] for b in whole_blocks), prefill_index=pi,
                prefill_key=keys[pi] if pi is not None else None, truncated_from=truncated_from,
            ))
        return sorted(infos, key=lambda info: info.start)
