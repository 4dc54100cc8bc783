"""``Orchestrator``: the async RAG SDK — question + documents in, answer + cache evidence out.

The path of one call: ``answer`` -> ``prompt_builder`` lays the prompt out (spans padded to
blocks, SSEP / PDEP placed, prefills listed) -> ``Scheduler`` warms the spans and sends the final
prompt (ISPS) -> an ``EngineBackend`` runs it (in-process ``AsyncLLM`` or ``minipic serve``).

Both constructors check that the prompt builder and the engine agree on the span configuration
(block size, SSEP / PDEP / PAD ids): a disagreement does not fail loudly in the engine, spans just
never hit, so it is refused here with ``ConfigMismatchError``.

Use one event loop for an orchestrator's lifetime (the embedded engine is bound to it); from sync
code use ``SyncOrchestrator``, which owns a loop thread and has the same methods.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator
from pydantic import ValidationError as PydanticValidationError

from minipic.orchestrator.backends import EngineBackend, Sampling
from minipic.orchestrator.errors import (
    BadInputError,
    ConfigMismatchError,
    MinipicError,
    from_build_error,
    with_index,
)
from minipic.orchestrator.results import Answer
from minipic.orchestrator.scheduler import Job, Policy, Scheduler, SchedulerEvent, SchedulerOptions
from minipic.orchestrator.warmth import WarmthRegistry
from minipic.prompt_builder import (
    BudgetPolicy,
    BuiltPrompt,
    EngineMismatchError,
    Mode,
    PromptBuilder,
    PromptBuildError,
    Span,
)
from minipic.prompt_builder.modes import ModeSpec, coerce_mode, parse_mode
from minipic.span_contract.model_support import ModelSupport

logger = logging.getLogger("minipic.orchestrator")

Document = str | Span | Mapping[str, Any]


def _store_dirs(backend: EngineBackend) -> Iterator[str]:
    """The span-store directories behind a backend (embedded settings or a server's report)."""
    settings = getattr(backend, "settings", None)
    store = getattr(settings, "span_store", None)
    dirs = (store.dir, store.shared_dir) if store is not None else getattr(
        backend, "span_store_dirs", ())
    yield from (d for d in dirs if d and os.path.isdir(d))


class Question(BaseModel):
    """One item of ``answer_many``; unset fields take the call's defaults."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # strict: bytes are not silently decoded into a question (``answer`` refuses them too)
    question: StrictStr
    documents: Sequence[Any] = Field(default_factory=list)
    system: StrictStr | None = None
    mode: Mode | ModeSpec | str | None = None  # a mode or its text form: selective@0.15
    cache_salt: StrictStr | None = None

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: Any) -> Any:
        return None if value is None else parse_mode(value)


def _coerce_options(options: SchedulerOptions | Mapping[str, Any] | None) -> SchedulerOptions:
    if options is None or isinstance(options, SchedulerOptions):
        return options or SchedulerOptions()
    try:
        return SchedulerOptions.model_validate(dict(options))
    except PydanticValidationError as exc:
        raise BadInputError(f"invalid scheduler options: {exc}") from None


def _sampling(kwargs: Sampling | Mapping[str, Any]) -> Sampling:
    if isinstance(kwargs, Sampling):  # validated already (a batch's call-wide settings)
        return kwargs
    try:
        return Sampling(**kwargs)
    except PydanticValidationError as exc:
        known = ", ".join(Sampling.model_fields)
        raise BadInputError(f"invalid sampling arguments (known: {known}): {exc}") from None


def _check_salt(salt: object) -> None:
    """A cache salt goes to the engine's block hash as is: a non-empty, valid-Unicode str."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise BadInputError(f"cache_salt must be a non-empty str or None, got {salt!r}"[:200])
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInputError("cache_salt is not valid Unicode (lone surrogate)") from None


def _coerce_question(item: Any, index: int) -> Question:
    if isinstance(item, Question):
        return item
    if isinstance(item, str):
        return Question(question=item)
    fields: Any = None
    if isinstance(item, Mapping):
        fields = dict(item)
    elif isinstance(item, tuple) and len(item) == 2:
        docs = item[1]
        if isinstance(docs, Iterable) and not isinstance(docs, (str, bytes, Mapping, Sequence)):
            docs = list(docs)  # a generator of documents
        fields = {"question": item[0], "documents": docs}
    if fields is not None:
        try:
            return Question.model_validate(fields)
        except PydanticValidationError as exc:
            raise BadInputError(f"question {index}: {exc}", question_index=index) from None
    raise BadInputError(
        f"question {index}: expected str, Question, mapping or (question, documents), got "
        f"{type(item).__name__}", question_index=index,
    )


class Orchestrator:
    """Async span-aware RAG client over one engine backend."""

    def __init__(
        self,
        backend: EngineBackend,
        builder: PromptBuilder | None = None,
        *,
        options: SchedulerOptions | Mapping[str, Any] | None = None,
        registry: WarmthRegistry | None = None,
    ) -> None:
        info = backend.info
        if builder is None:
            ids = info.span_config.model_dump(exclude={"block_size"}) if info.span_config else {}
            block_size = info.span_config.block_size if info.span_config else 32
            builder = PromptBuilder.from_pretrained(
                info.tokenizer, block_size=block_size, max_model_len=info.max_model_len, **ids
            )
        if info.span_config is not None:
            try:
                builder.check_engine(info.span_config)
            except EngineMismatchError as exc:
                raise ConfigMismatchError(f"{info.kind} engine {info.model}: {exc}") from None
        self.backend = backend
        self.builder = builder
        self._fallback_logged = False
        self.scheduler = Scheduler(backend, _coerce_options(options), registry)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def embedded(
        cls,
        model: str | None = None,
        *,
        options: SchedulerOptions | Mapping[str, Any] | None = None,
        learn_stored_spans: bool = True,
        **engine_args: Any,
    ) -> Orchestrator:
        """Start vLLM's ``AsyncLLM`` in this process with the minipic plugin on.

        ``model``: a model folder, ``"tiny-llama"``, or None for the default SmolLM2-135M.
        ``engine_args``: ``EngineSettings`` fields (``block_size``, ``max_model_len``, ``pic``,
        ``features``, ``span_store``, ...) and any other vLLM engine argument. Blocks while the
        model loads (tens of seconds on CPU); scripts that call it need an
        ``if __name__ == "__main__":`` guard. With a ``span_store`` and ``learn_stored_spans``,
        the spans ``minipic index`` put into the store are warm from the start
        (``learn_stored_spans()``).
        """
        from minipic.orchestrator.embedded_backend import EmbeddedBackend, settings_from_args

        try:
            settings = settings_from_args(model, engine_args)
        except (PydanticValidationError, ValueError) as exc:
            raise BadInputError(f"invalid engine arguments: {exc}") from None
        backend = EmbeddedBackend.start(settings)
        try:
            span = settings.span_config
            assert span is not None
            builder = PromptBuilder.from_pretrained(
                settings.model, block_size=span.block_size, ssep_id=span.ssep_id,
                pdep_id=span.pdep_id, pad_id=span.pad_id, max_model_len=settings.max_model_len,
                sink_ids=span.sink_ids, sink_gap=span.sink_gap,
            )
            orc = cls(backend, builder, options=options)
            if learn_stored_spans and settings.span_store is not None:
                orc.learn_stored_spans()
            return orc
        except BaseException:
            backend.close()
            raise

    @classmethod
    def connect(
        cls,
        base_url: str,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        options: SchedulerOptions | Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        allow_plugin_off: bool = False,
        learn_stored_spans: bool = True,
    ) -> Orchestrator:
        """Talk to ``minipic serve`` at ``base_url`` (blocking: two GETs to check it).

        ``model``: the served model name (None: the only one). ``tokenizer``: local model folder
        for the prompt builder (None: the server's model folder if it exists here, else minipic's
        default model). Raises ``EngineUnreachableError`` when nothing answers and
        ``ConfigMismatchError`` when the server's span configuration differs from the builder's.
        With ``learn_stored_spans``, spans ``minipic index`` put into the server's span store
        are warm from the start when the store's directory is readable here.
        """
        from minipic.orchestrator.http_backend import HttpBackend

        backend = HttpBackend.connect(base_url, model, tokenizer, headers=headers,
                                      allow_plugin_off=allow_plugin_off)
        orc = cls(backend, options=options)
        if learn_stored_spans:
            orc.learn_stored_spans()
        return orc

    # -- configuration --------------------------------------------------------------------------

    @property
    def options(self) -> SchedulerOptions:
        return self.scheduler.options

    @options.setter
    def options(self, value: SchedulerOptions | Mapping[str, Any]) -> None:
        self.scheduler.options = _coerce_options(value)

    def configure(self, **changes: Any) -> SchedulerOptions:
        """Change scheduler options in place (e.g. ``configure(policy="barrier")``)."""
        self.options = self.options.model_dump() | changes
        return self.options

    @property
    def registry(self) -> WarmthRegistry:
        return self.scheduler.registry

    def learn_stored_spans(self, store_dir: str | os.PathLike[str] | None = None, *,
                           fingerprint: str | None = None) -> int:
        """Mark the spans ``minipic index`` put into a span store as warm, so no prefill is
        sent for them (their blocks load from the store into the final prompt). Returns how
        many spans the registry learned.

        ``store_dir``: the store's directory (None: the embedded engine's store directories,
        or those a ``minipic serve --span-store`` server reports). Only manifest records
        written for this engine's configuration count (``fingerprint``; None: the embedded
        engine's, computed here, or the server's from ``/minipic/config``). Why a local file
        and not a question to the engine: ``orchestrator.span_index``.
        """
        from minipic.orchestrator.span_index import embedded_fingerprint, stored_warm_keys

        dirs = [store_dir] if store_dir is not None else list(_store_dirs(self.backend))
        if fingerprint is None:
            fingerprint = (getattr(self.backend, "span_store_fingerprint", None)
                           or embedded_fingerprint(self.backend))
        if not dirs or fingerprint is None:
            return 0
        return self.registry.learn_stored(stored_warm_keys(dirs, fingerprint))

    @contextlib.contextmanager
    def record_events(self) -> Iterator[list[SchedulerEvent]]:
        """Collect the scheduler's events while the block runs (the list fills as it runs)."""
        log: list[SchedulerEvent] = []
        self.scheduler.listeners.append(log.append)
        try:
            yield log
        finally:
            self.scheduler.listeners.remove(log.append)

    # -- prompts --------------------------------------------------------------------------------

    def build(
        self,
        question: str,
        documents: Sequence[Document] = (),
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        max_tokens: int = 64,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
    ) -> BuiltPrompt:
        """The prompt ``answer`` would send, or ``BadInputError`` / ``SpanTooLongError``."""
        if not isinstance(question, str) or not question.strip():
            raise BadInputError("question is empty" if isinstance(question, str)
                                else f"question must be a str, got {type(question).__name__}")
        if isinstance(documents, (str, bytes)):
            raise BadInputError("documents must be a list of documents, not one string")
        if isinstance(documents, Mapping) or not isinstance(documents, Iterable):
            raise BadInputError(f"documents must be a list of documents, got "
                                f"{type(documents).__name__}")
        documents = list(documents)
        if require_documents and not documents:
            raise BadInputError("no documents given (pass require_documents=False to answer "
                                "from the model alone)")
        try:
            chosen = coerce_mode(mode)
            support = self.backend.info.model_support
            if support is not None and not support.position_free and chosen is not Mode.PREFIX:
                # the documents as the plain prompt: exact answers, stock prefix caching
                if not self._fallback_logged:
                    self._fallback_logged = True
                    logger.warning("minipic: documents are answered as plain prompts: %s",
                                   support.summary())
                chosen = mode = Mode.PREFIX
            if self.backend.info.span_config is None and chosen is not Mode.PREFIX:
                raise BadInputError(f"the engine runs without the minipic plugin; mode "
                                    f"'{chosen.value}' needs it (use mode='prefix')")
            return self.builder.build(
                question=question, system=system, spans=list(documents), mode=mode,
                max_tokens=max_tokens, budget=budget,
            )
        except PromptBuildError as exc:
            raise from_build_error(exc) from exc

    async def check_model(self) -> ModelSupport | None:
        """Whether the engine's model is position-free, asked once before the first prompt is
        built (an embedded engine can only be asked on the loop it answers on). On a model that
        is not, every question is answered from the plain prompt, and ``Answer.fallback`` says
        why."""
        fetch = getattr(self.backend, "fetch_model_support", None)
        if self.backend.info.model_support is None and fetch is not None:
            await fetch()
        return self.backend.info.model_support

    def _prepare(
        self,
        question: str,
        documents: Sequence[Document],
        system: str | None,
        mode: Mode | str,
        *,
        cache_salt: str | None,
        budget: BudgetPolicy | str,
        require_documents: bool,
        sampling: Sampling | Mapping[str, Any],
    ) -> tuple[BuiltPrompt, Sampling]:
        """One question's arguments checked and laid out, as every way of asking it sends them
        (``answer``, each ``answer_many`` item, ``warm``, ``streaming.stream_answer``): the
        sampling settings, then the cache salt, then the prompt (``build``). Raises
        ``BadInputError`` / ``SpanTooLongError`` before anything is sent."""
        params = _sampling(sampling)
        _check_salt(cache_salt)
        prompt = self.build(question, documents, system, mode, max_tokens=params.max_tokens,
                            budget=budget, require_documents=require_documents)
        return prompt, params

    # -- answering ------------------------------------------------------------------------------

    async def answer(
        self,
        question: str,
        documents: Sequence[Document] = (),
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        cache_salt: str | None = None,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
        skip_warm: bool | None = None,
        **sampling: Any,
    ) -> Answer:
        """Answer one question from ``documents`` (each one a cacheable span).

        ``sampling``: ``max_tokens`` (64), ``temperature`` (0), ``top_p``, ``seed``, ``stop``.
        ``cache_salt`` scopes the cache (tenants never share spans across salts). Raises a
        ``MinipicError`` subclass on failure. A blank question is ``BadInputError``; a document
        with no content (empty, whitespace only) is left out and named in
        ``Answer.skipped_spans`` — a retriever's empty hit must not fail the question.
        """
        await self.check_model()
        prompt, params = self._prepare(question, documents, system, mode, cache_salt=cache_salt,
                                       budget=budget, require_documents=require_documents,
                                       sampling=sampling)
        job = Job(0, question, prompt, params, cache_salt)
        (result,) = await self.scheduler.run([job], skip_warm=skip_warm)
        if isinstance(result, MinipicError):
            result.question_index = None
            raise result
        return result

    async def answer_many(
        self,
        questions: Sequence[Question | str | Mapping[str, Any] | tuple[str, Sequence[Document]]],
        documents: Sequence[Document] | None = None,
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        cache_salt: str | None = None,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
        policy: Policy | None = None,
        skip_warm: bool | None = None,
        **sampling: Any,
    ) -> list[Answer | MinipicError]:
        """Answer a batch with ISPS (or ``policy="barrier"``). One result per question, in order:
        an ``Answer`` or the ``MinipicError`` that question ended with (``question_index`` set);
        bad input in one question does not stop the others.

        Each item is a ``Question``, a mapping of its fields, a ``(question, documents)`` pair,
        or a bare question string that uses ``documents``; ``system``, ``mode`` and
        ``cache_salt`` are defaults for items that do not set them. Whatever an item holds, it
        ends as its own ``Answer`` or ``BadInputError``; only a ``questions`` that is not a list
        at all, or invalid call-wide options, raise ``BadInputError`` for the whole call.
        """
        if isinstance(questions, (str, bytes, Mapping)) or not isinstance(questions, Iterable):
            raise BadInputError(f"questions must be a list, got {type(questions).__name__}")
        questions = list(questions)
        await self.check_model()
        params = _sampling(sampling)
        _check_salt(cache_salt)
        results: list[Answer | MinipicError | None] = [None] * len(questions)
        jobs: list[Job] = []
        for i, item in enumerate(questions):
            try:
                jobs.append(self._job(i, item, documents, system, mode, cache_salt, budget,
                                      require_documents, params))
            except MinipicError as exc:
                results[i] = with_index(exc, i)
            except Exception as exc:  # one item's input must not sink the batch
                err = BadInputError(f"question {i}: cannot build a prompt from this input "
                                    f"({type(exc).__name__}: {exc})"[:500], question_index=i)
                err.__cause__ = exc
                results[i] = err
        for job, result in zip(jobs, await self.scheduler.run(jobs, policy=policy,
                                                              skip_warm=skip_warm), strict=True):
            results[job.index] = result
        done = [r for r in results if r is not None]
        assert len(done) == len(results), "every question ends as an answer or an error"
        return done

    def _job(
        self, index: int, item: Any, documents: Any, system: str | None, mode: Mode | str,
        cache_salt: str | None, budget: BudgetPolicy | str, require_documents: bool,
        params: Sampling,
    ) -> Job:
        """One ``answer_many`` item as a job with its built prompt (or ``BadInputError``)."""
        q = _coerce_question(item, index)
        docs = q.documents if q.documents or documents is None else documents
        prompt, _ = self._prepare(q.question, docs, q.system if q.system is not None else system,
                                  q.mode or mode, cache_salt=q.cache_salt, budget=budget,
                                  require_documents=require_documents, sampling=params)
        return Job(index, q.question, prompt, params, q.cache_salt or cache_salt)

    async def warm(
        self,
        documents: Sequence[Document],
        system: str | None = None,
        *,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        cache_salt: str | None = None,
    ) -> int:
        """Prefill these documents' spans now (e.g. a corpus, or an agent's tool descriptions)
        so later questions find them warm. Returns how many prefills it sent."""
        await self.check_model()
        prompt, _ = self._prepare("?", documents, system, mode, cache_salt=cache_salt,
                                  budget=BudgetPolicy.ERROR, require_documents=True,
                                  sampling={"max_tokens": 1})
        return await self.scheduler.prewarm(prompt, cache_salt)

    async def reset_cache(self) -> None:
        """Empty the engine's prefix cache and forget what was warm in it (spans a span store
        holds stay warm: the store is not reset)."""
        await self.backend.reset_cache()
        self.registry.reset()

    async def aclose(self) -> None:
        await self.backend.aclose()

    async def __aenter__(self) -> Orchestrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
