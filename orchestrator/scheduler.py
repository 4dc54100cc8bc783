"""Where the schedule is decided: which span prefills run, when each final prompt goes, and what
happens when the engine fails or forgets.

ISPS (DESIGN §3), per question:

1. For each span prefill of its prompt (``BuiltPrompt.span_prefills``): skip it when the warmth
   registry says it is warm (``skip_warm``), join it when another question already has it in
   flight (one shared task per ``(cache_salt, prefill_key)``), else start it (``max_tokens=1``).
2. As soon as *its own* prefills are done, send the final prompt. Other questions' prefills and
   decodes keep running; nothing waits for the batch. Engine slots (``max_in_flight``) go to the
   oldest question first (``PrioritySlots``), and span prefills may hold only some of them
   (``max_prefills_in_flight``), so a final whose spans are warm is not stuck behind the
   prefills of later questions.
3. Check the final's cached-token count against ``expected_cached_tokens``
   (``warmth.check_cache``). A shortfall is reported (``on_cold="report"``, the default), or the
   cold spans are re-warmed and the final sent once more (``"retry"``), or it is raised
   (``"raise"``). Why reporting is enough: the engine isolates spans inside any request, so a
   span found cold was computed alone inside the final — the output equals the warm one, and the
   final left the span cached. Re-sending would only buy a warm time-to-first-token.

``policy="barrier"`` is the baseline: prefill every span of the batch, wait for all, then send
every final.

Failures: a retryable error (connection lost, 5xx) retries the whole question — warm, then final
— within that question's own budget (``RetryBudget``: attempts, and time from its first
failure). The waiting is shared: the first failure opens the orchestrator's ``Circuit``, which
holds every request back, backs off, probes the engine's health and re-reads its span
configuration before letting them go (``ConfigMismatchError`` if the server came back with
another one). A lost connection also resets the registry, once per outage, because a server that
restarts comes back with an empty cache. Every question ends as an ``Answer`` or a
``MinipicError`` value: ``run`` never drops one and never raises for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from minipic.orchestrator.backends import Completion, EngineBackend, Sampling
from minipic.orchestrator.circuit import Circuit
from minipic.orchestrator.errors import (
    CacheMismatchError,
    EngineUnreachableError,
    MinipicError,
    RequestTimeoutError,
    with_index,
)
from minipic.orchestrator.results import Answer, SpanStatus, fallback_reason
from minipic.orchestrator.retry import RetryBudget, RetryPolicy
from minipic.orchestrator.slots import PrioritySlots
from minipic.orchestrator.warmth import CacheCheck, WarmKey, WarmthRegistry, check_cache
from minipic.prompt_builder import BuiltPrompt

Policy = Literal["isps", "barrier"]
PREFILL_SAMPLING = Sampling(max_tokens=1)  # a span prefill only fills the cache
DEFAULT_MAX_PREFILLS = 8  # span prefills in flight when not configured (see SchedulerOptions)


class _SpansLost(Exception):  # a signal inside the scheduler, not an error
    """The registry was reset (an engine restart, ``reset_cache``) after this question warmed
    its spans and before its final prompt went: they are gone, warm them again first."""


class SchedulerOptions(BaseModel):
    """How the scheduler behaves; every field can be changed per orchestrator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Policy = "isps"
    skip_warm: bool = Field(True, description="skip prefills of spans the registry says are warm")
    # 64 in flight, at most 8 of them span prefills, against the former 8 / 4
    # (benchmarks/answer_many_vs_gather.py, results/answer_many_vs_gather.json: SmolLM2, 2 CPU
    # cores): +42% samples/s over warm spans (finals decode together), +10% cold, same median
    # first token. Half of 64 as prefills gave +15% cold but the median first token 20% later:
    # the engine serves 32 queued prefills first-come, not oldest question first.
    max_in_flight: int = Field(64, ge=1, description="engine requests in flight at once")
    max_prefills_in_flight: int | None = Field(
        None, ge=1, description="of those, span prefills (None: half, at least 1, at most "
                                f"{DEFAULT_MAX_PREFILLS})")
    request_timeout_s: float | None = Field(300.0, gt=0, description="per engine request")
    # "report" by default: the engine computes a cold span in isolation inside the final (span
    # isolation, engine_ext/attention/span_isolation.py), so the answer is the one warm spans give
    # and the span is cached afterwards; re-sending the final ("retry") only buys a warm TTFT.
    on_cold: Literal["retry", "report", "raise"] = "report"
    retry: RetryPolicy = RetryPolicy()


EventKind = Literal[
    "prefill_sent", "prefill_done", "prefill_failed", "final_sent", "final_done", "final_failed",
    "cold", "retry", "registry_reset", "circuit_open", "circuit_closed",
]


def _step(kind: Literal["prefill", "final"], phase: Literal["sent", "done", "failed"]
          ) -> EventKind:
    return cast(EventKind, f"{kind}_{phase}")


@dataclass(frozen=True)
class SchedulerEvent:
    """One step of the schedule, for logs and tests (``Orchestrator.record_events``)."""

    kind: EventKind
    t: float  # time.perf_counter()
    job: int | None = None  # the question's submission number
    key: str | None = None  # prefill key (prefill events, cold)
    detail: str = ""


@dataclass
class Job:
    """One question, its built prompt and how to run it."""

    index: int  # position in the caller's batch
    question: str
    prompt: BuiltPrompt
    sampling: Sampling
    cache_salt: str | None = None
    seq: int = -1  # submission number, set by the scheduler: lower = served first


@dataclass
class _Batch:
    """What the questions of one ``run`` share."""

    skip_warm: bool
    believed_warm: set[WarmKey]  # snapshot at the start: these needed no prefill
    done: dict[WarmKey, int] = field(default_factory=dict)  # prefilled in this batch -> epoch
    started: float = field(default_factory=time.perf_counter)  # Answer.total_s counts from here
    prefilled_for: dict[int, int] = field(default_factory=dict)  # seq -> prefills it started


@dataclass
class _Prefill:
    task: asyncio.Task[None]
    epoch: int  # registry epoch it started in: after a reset it warms nothing we trust


@dataclass
class _LoopState:
    """Per-event-loop objects (futures and waiters belong to the loop that made them)."""

    slots: PrioritySlots  # every engine request
    prefill_slots: PrioritySlots  # span prefills only: the rest stay free for ready finals
    circuit: Circuit  # is the engine up: shared by every request of this orchestrator
    inflight: dict[WarmKey, _Prefill] = field(default_factory=dict)


class Scheduler:
    """Runs jobs on one backend, sharing one warmth registry across calls."""

    def __init__(
        self, backend: EngineBackend, options: SchedulerOptions | None = None,
        registry: WarmthRegistry | None = None,
    ) -> None:
        self.backend = backend
        self.options = options or SchedulerOptions()
        self.registry = registry or WarmthRegistry()
        self.listeners: list[Callable[[SchedulerEvent], None]] = []
        self._seq = itertools.count()
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}

    # -- plumbing -------------------------------------------------------------------------------

    def _emit(self, kind: EventKind, job: int | None = None, key: str | None = None,
              detail: str = "") -> None:
        if self.listeners:
            event = SchedulerEvent(kind, time.perf_counter(), job, key, detail)
            for listener in list(self.listeners):
                listener(event)

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        total = self.options.max_in_flight
        prefills = min(total, self.options.max_prefills_in_flight
                       or max(1, min(DEFAULT_MAX_PREFILLS, total // 2)))
        state = self._states.get(loop)
        if state is None or (state.slots.limit, state.prefill_slots.limit) != (total, prefills):
            self._states = {lp: s for lp, s in self._states.items() if not lp.is_closed()}
            circuit = state.circuit if state is not None else Circuit(
                self.backend, lambda: self.options.retry, on_open=self._circuit_opened,
                on_close=lambda down: self._emit("circuit_closed", detail=f"down {down:.2f}s"),
                on_restart=self._server_restarted)
            state = _LoopState(PrioritySlots(total), PrioritySlots(prefills), circuit)
            self._states[loop] = state
        return state

    def _circuit_opened(self, exc: MinipicError) -> None:
        self._emit("circuit_open", detail=f"{type(exc).__name__}: {exc}"[:200])
        if isinstance(exc, EngineUnreachableError):  # a restarted server has an empty cache
            self.registry.reset()
            self._emit("registry_reset", detail=str(exc)[:200])

    def _server_restarted(self) -> None:
        """The server came back as another process (whatever the failure looked like from
        here, e.g. a stream cut mid-chunk rather than a refused connection): empty cache."""
        self.registry.reset()
        self._emit("registry_reset", detail="server restarted (new /minipic/config instance)")

    @property
    def circuit(self) -> Circuit:
        """This event loop's circuit (tests and logs: ``probes``, ``is_open``, ``level``)."""
        return self._state().circuit

    async def _call(
        self, token_ids: Sequence[int], sampling: Sampling, salt: str | None, *,
        kind: Literal["prefill", "final"], job: int, budget: RetryBudget,
        key: str | None = None, warmed_in: int | None = None,
        route_as: Sequence[int] | None = None,
    ) -> Completion:
        """One engine request: wait for the engine to be up (the circuit, until ``budget``'s
        deadline) and for a slot (oldest question first), bound it in time.

        Span prefills also need one of the fewer prefill slots, so a final prompt whose spans
        just became warm finds a free slot instead of queueing behind other questions' prefills.
        The circuit is passed before the slots (every waiting question starts its clock when the
        outage reaches it, not when a slot does) and again after (it may have opened meanwhile).
        A final prompt whose spans were warmed in registry epoch ``warmed_in`` is not sent once
        the registry was reset since (``_SpansLost``): a final that waited out an engine restart
        would otherwise find every span it relies on gone.
        """
        state = self._state()
        await state.circuit.ready(budget)
        async with contextlib.AsyncExitStack() as slots:
            if kind == "prefill":
                await slots.enter_async_context(state.prefill_slots.hold(priority=job))
            await slots.enter_async_context(state.slots.hold(priority=job))
            generation = await state.circuit.ready(budget)
            if warmed_in is not None and warmed_in != self.registry.epoch:
                raise _SpansLost
            self._emit(_step(kind, "sent"), job, key)
            try:
                async with asyncio.timeout(self.options.request_timeout_s):
                    done = await self.backend.generate(token_ids, sampling=sampling,
                                                       cache_salt=salt, route_as=route_as)
            except TimeoutError:
                self._emit(_step(kind, "failed"), job, key, "timeout")
                raise RequestTimeoutError(
                    f"{kind} request took longer than {self.options.request_timeout_s} s"
                ) from None
            except MinipicError as exc:
                self._emit(_step(kind, "failed"), job, key, type(exc).__name__)
                if exc.retryable:
                    state.circuit.failed(exc, generation)
                raise
        state.circuit.succeeded()
        self._emit(_step(kind, "done"), job, key, f"cached={done.cached_tokens}")
        return done

    # -- span prefills --------------------------------------------------------------------------

    async def _prefill(self, wkey: WarmKey, ids: list[int], job: int, epoch: int,
                       batch: _Batch, budget: RetryBudget, final: Sequence[int]) -> None:
        await self._call(ids, PREFILL_SAMPLING, wkey[0], kind="prefill", job=job,
                         budget=budget, key=wkey[1], route_as=final)
        if self.registry.mark_warm(wkey, len(ids), epoch=epoch):
            batch.done[wkey] = epoch

    def _warm_task(self, wkey: WarmKey, ids: list[int], job: int, batch: _Batch,
                   force: bool, budget: RetryBudget,
                   final: Sequence[int]) -> tuple[asyncio.Task[None] | None, bool]:
        """The prefill this question must wait for (None: none needed) and whether it started
        it. Joins one in flight for the same key; never starts a second one. A started prefill
        waits for a down engine as long as its starter's ``budget`` allows."""
        state = self._state()
        epoch = self.registry.epoch
        running = state.inflight.get(wkey)
        if running is not None and running.epoch == epoch and not running.task.done():
            return running.task, False
        if not force:
            if batch.skip_warm and self.registry.is_warm(wkey):
                return None, False
            if batch.done.get(wkey) == epoch:
                return None, False
        task = asyncio.get_running_loop().create_task(
            self._prefill(wkey, ids, job, epoch, batch, budget, final),
            name=f"prefill-{wkey[1][:8]}")
        entry = _Prefill(task, epoch)
        state.inflight[wkey] = entry

        def _forget(t: asyncio.Task[None]) -> None:
            if state.inflight.get(wkey) is entry:
                del state.inflight[wkey]
            if not t.cancelled():
                t.exception()  # retrieved here; waiters get it from their own await

        task.add_done_callback(_forget)
        batch.prefilled_for[job] = batch.prefilled_for.get(job, 0) + 1
        return task, True

    async def _warm(self, job: Job, batch: _Batch, force: set[str],
                    budget: RetryBudget) -> None:
        """Make every span prefill of the job's prompt complete (starting what is missing)."""
        waits: list[asyncio.Task[None]] = []
        for key, ids in zip(job.prompt.prefill_keys, job.prompt.span_prefills, strict=True):
            task, _ = self._warm_task((job.cache_salt, key), ids, job.seq, batch,
                                      force=key in force, budget=budget,
                                      final=job.prompt.prompt_token_ids)
            if task is not None:
                waits.append(task)
        for task in waits:
            await asyncio.shield(task)  # a cancelled waiter must not cancel a shared prefill

    # -- one question ---------------------------------------------------------------------------

    async def _run_job(self, job: Job, batch: _Batch) -> Answer:
        opts = self.options
        started = batch.started  # Answer.total_s: a question waiting for a slot is waiting
        budget = RetryBudget(opts.retry)  # retries: this question's own, from its first failure
        finals = 0
        force: set[str] = set()
        rewarmed = False
        while True:
            epoch = self.registry.epoch
            try:
                await self._warm(job, batch, force, budget)
                force = set()
                done = await self._call(job.prompt.prompt_token_ids, job.sampling,
                                        job.cache_salt, kind="final", job=job.seq,
                                        budget=budget, warmed_in=epoch)
                finals += 1
            except _SpansLost:
                self._emit("retry", job.seq, detail="registry reset while waiting: re-warming")
                continue
            except MinipicError as exc:
                if not (exc.retryable and budget.failed()):
                    raise
                # no sleep here: the next send waits at the circuit, which backs off for all
                self._emit("retry", job.seq, detail=f"{type(exc).__name__} "
                                                    f"(failure {budget.failures})")
                continue
            check = check_cache(job.prompt, done.cached_tokens)
            if check.ok:
                break
            # a server restarted with another span configuration looks like this: say so
            await self._state().circuit.check_config()
            cold = [(job.cache_salt, k) for k in check.cold_keys]
            self.registry.mark_cold(cold)
            for wkey in cold:
                batch.done.pop(wkey, None)
            self._emit("cold", job.seq, detail=f"cached {check.cached} < {check.expected}: "
                                               f"{len(cold)} span(s) cold")
            if opts.on_cold == "retry" and not rewarmed:
                rewarmed = True
                force = set(check.cold_keys)
                continue
            if opts.on_cold == "raise":
                raise CacheMismatchError(
                    f"engine cached {check.cached} prompt tokens, layout expects "
                    f"{check.expected}" + (" after re-warming" if rewarmed else ""),
                    expected=check.expected, cached=check.cached,
                    cold_spans=self._cold_span_ids(job.prompt, check),
                )
            break
        total = time.perf_counter() - started
        return Answer(
            question=job.question, text=done.text, token_ids=done.token_ids,
            mode=job.prompt.mode, ttft_s=done.ttft_s, warm_s=max(0.0, total - done.latency_s),
            total_s=total, prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
            expected_cached_tokens=check.expected, cache_ok=check.ok,
            spans=self._span_statuses(job, batch, check),
            prefills_sent=batch.prefilled_for.get(job.seq, 0),
            attempts=finals, finish_reason=done.finish_reason, budget=job.prompt.budget,
            skipped_spans=job.prompt.skipped_spans, fallback=fallback_reason(self.backend),
        )

    @staticmethod
    def _cold_span_ids(prompt: BuiltPrompt, check: CacheCheck) -> list[str]:
        return [s.span_id for i, s in enumerate(prompt.spans) if check.hits.get(i) is False]

    @staticmethod
    def _span_statuses(job: Job, batch: _Batch, check: CacheCheck) -> list[SpanStatus]:
        out = []
        for i, span in enumerate(job.prompt.spans):
            if span.prefill_key is None:
                status = "uncached"
            elif (job.cache_salt, span.prefill_key) in batch.believed_warm:
                status = "warm"
            else:
                status = "cold"
            out.append(SpanStatus(
                kind=span.kind, span_id=span.span_id, index=span.index, tokens=span.token_count,
                prefill_key=span.prefill_key, status=status, hit=check.hits.get(i),
            ))
        return out

    # -- a batch --------------------------------------------------------------------------------

    async def _guarded(self, job: Job, batch: _Batch) -> Answer | MinipicError:
        try:
            return await self._run_job(job, batch)
        except MinipicError as exc:
            return with_index(exc, job.index)
        except Exception as exc:  # a bug must still surface as this question's result
            err = MinipicError(f"internal error: {type(exc).__name__}: {exc}",
                               question_index=job.index)
            err.__cause__ = exc
            return err

    async def _barrier_prefills(self, jobs: Sequence[Job], batch: _Batch) -> None:
        tasks = {}
        for job in jobs:
            budget = RetryBudget(self.options.retry)
            for key, ids in zip(job.prompt.prefill_keys, job.prompt.span_prefills, strict=True):
                task, _ = self._warm_task((job.cache_salt, key), ids, job.seq, batch,
                                          force=False, budget=budget,
                                          final=job.prompt.prompt_token_ids)
                if task is not None:
                    tasks[id(task)] = task
        # failures surface again, per question, when each one warms its own spans
        await asyncio.gather(*(asyncio.shield(t) for t in tasks.values()),
                             return_exceptions=True)

    async def run(
        self, jobs: Sequence[Job], *, policy: Policy | None = None,
        skip_warm: bool | None = None,
    ) -> list[Answer | MinipicError]:
        """Answer every job; the result list is parallel to ``jobs`` (errors as values)."""
        policy = policy or self.options.policy
        if policy not in ("isps", "barrier"):
            raise ValueError(f"unknown policy {policy!r}; known: isps, barrier")
        skip = self.options.skip_warm if skip_warm is None else skip_warm
        for job in jobs:
            job.seq = next(self._seq)
        believed = {
            (job.cache_salt, key) for job in jobs for key in job.prompt.prefill_keys
            if skip and (job.cache_salt, key) in self.registry
        }
        batch = _Batch(skip_warm=skip, believed_warm=believed)
        if policy == "barrier":
            await self._barrier_prefills(jobs, batch)
        return list(await asyncio.gather(*(self._guarded(job, batch) for job in jobs)))

    async def prewarm(self, prompt: BuiltPrompt, cache_salt: str | None = None) -> int:
        """Run the prompt's span prefills now (no final prompt); returns how many were sent.
        Raises the first failure (nothing to report per question here)."""
        job = Job(-1, "", prompt, PREFILL_SAMPLING, cache_salt, seq=next(self._seq))
        batch = _Batch(skip_warm=self.options.skip_warm, believed_warm=set())
        await self._warm(job, batch, set(), RetryBudget(self.options.retry))
        return batch.prefilled_for.get(job.seq, 0)
