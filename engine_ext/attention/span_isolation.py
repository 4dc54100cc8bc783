"""The span rules in the worker: which keys each query of a step may attend to, and where RoPE
puts every token of a span request.

Two rules (docs/design.md §2), both functions of a request's prompt tokens: span isolation (the
first key each query may attend to, ``key_start``) and rule 1 (SSEP, PDEP and PAD are attended by
no query but their own and take no position: each key's logical position, each query's shift
from its physical one). :func:`step_span_view` derives both for the step being built, once, for
every layer's attention. The tokens the model generated obey neither: they are real tokens at
their real positions, attending to every real key before them (a decoded PAD is part of the
answer, and a decoded SSEP opens no span).

Attention metadata (``CommonAttentionMetadata``) carries lengths and block tables but no token
ids, while the isolation rule (``engine_ext/attention/span_segments.py``) is a function of the
tokens at block starts — including blocks that were cached, not computed, in this step. The model
runner has them all: its persistent batch keeps every request's tokens
(``input_batch.token_ids_cpu``, row ``r`` = the step's request ``r``) and its request states keep
the sampling params that say whether a request opted in to span semantics.

So we wrap ``GPUModelRunner._build_attention_metadata`` (the CPU runner inherits it) to note
which runner is building metadata; a position-free metadata builder then asks
:func:`step_span_view` for the step's per-token ``key_start`` while it builds. Outside that call
(profiling runs) there is no step and isolation is off. A step that computes opted-in tokens
outside the hook (vLLM's V2 model runner never calls the wrapped method) is refused:
``engine_ext/vllm_surface/integration_guard.py`` marks such steps with :func:`expect_isolated_step`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minipic.engine_ext.attention.span_segments import (
    block_segments,
    query_segments,
    span_hidden,
    span_sinks,
)
from minipic.engine_ext.holes import worker_positions
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import SpanConfig, spans_opted_in

TARGET = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata"
_STEP = threading.local()
_STATE: dict[str, Any] = {"config": None}


def install(config: SpanConfig) -> None:
    """Wrap the runner's metadata build (worker; idempotent)."""
    from minipic.engine_ext.vllm_surface import patches

    _STATE["config"] = config

    def factory(stock: Any) -> Any:
        @functools.wraps(stock)
        def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
            previous = getattr(_STEP, "runner", None)
            _STEP.runner = self
            try:
                return stock(self, *args, **kwargs)
            finally:
                _STEP.runner = previous

        return _build_attention_metadata

    patches.apply("rope", {TARGET: factory})


@dataclass
class IsolatedStep:
    builds: int = 0  # position-free builders that asked for key starts inside the hook


@contextlib.contextmanager
def expect_isolated_step() -> Iterator[IsolatedStep]:
    """The step run inside this block computes opted-in tokens: every builder's request for key
    starts must come from inside the isolation hook (else :class:`EngineIntegrationError`)."""
    previous = getattr(_STEP, "expected", None)
    _STEP.expected = step = IsolatedStep()
    try:
        yield step
    finally:
        _STEP.expected = previous


def step_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                   ) -> torch.Tensor | None:
    """Logical positions of the step being built when a request of it computes several holes
    (``engine_ext/holes/worker_positions.py``), else None (every row is one window ending at its
    ``seq_len``). Outside the hook (profiling runs): None."""
    return worker_positions.positions_with_holes(getattr(_STEP, "runner", None), query_start_loc,
                                         seq_lens)


@dataclass
class SpanView:
    """What the span rules ask of one step's attention, beyond stock causal attention.

    * ``key_start[t]``: the first key query ``t`` may attend to (span isolation; None: 0 for
      every query, the stock fast path);
    * rule 1 (docs/design.md §2): the layout tokens (SSEP, PDEP, PAD of the prompt; a generated
      one is a real token) are attended by no query but their own and take no RoPE position.
      ``masked[r]`` says request row ``r`` has layout tokens among its keys, so it needs a key
      mask; ``key_positions[r, j]`` is the logical
      position of its key ``j`` (the count of real tokens before it; -1: a layout key) and
      ``query_shift[t]`` the logical minus the physical position of query ``t`` (the model
      rotated queries at vLLM's physical positions; attention moves them by this).
    * the sink (docs/design.md §2): the model's opening, copied after a span's SSEP, and the
      copy of a head computed in context before the span are seen only by their own span.
      ``key_sink[r, j]`` marks such a key (its ``key_positions`` entry is its virtual position,
      >= 0: just before the span's first shown token); only the queries
      with ``query_isolated[t]`` (rows inside an SSEP-led segment, whose ``key_start`` already
      keeps them inside their own span) may attend to it. None: no sink key in the step
      (``query_isolated`` is there whenever a request is masked).
    * ``req_ids[r]``: the request of row ``r`` (masked rows; what lets attention keep a
      request's keys from one step to the next, ``attention/masked_rows.py``).
    """

    key_start: torch.Tensor | None = None
    masked: torch.Tensor | None = None  # [num_reqs] bool
    key_positions: torch.Tensor | None = None  # [num_reqs, W] int64 (rows of masked requests)
    query_shift: torch.Tensor | None = None  # [num_tokens] int64
    key_sink: torch.Tensor | None = None  # [num_reqs, W] bool
    query_isolated: torch.Tensor | None = None  # [num_tokens] bool
    req_ids: list[str | None] | None = None  # [num_reqs]

    @property
    def any_masked(self) -> bool:
        return self.masked is not None and bool(self.masked.any())


@dataclass
class _RowView:
    """One request's part of a :class:`SpanView` (its keys, and its queries in the step)."""

    key_start: np.ndarray  # [q] int64
    query_shift: np.ndarray  # [q] int64
    key_positions: np.ndarray  # [seq_len] int64 (-1: layout)
    sink: np.ndarray  # [seq_len] bool
    isolated: np.ndarray  # [q] bool


def prompt_layout(tokens: np.ndarray, num_prompt_tokens: int, config: SpanConfig
                  ) -> np.ndarray:
    """Bool per token of ``tokens`` (a request's, from token 0): rule 1's layout tokens.

    Only a prompt token can be layout (docs/design.md §2): the client lays out the prompt, the
    model's output is the answer. A PAD / SSEP / PDEP id the model generates is a word of its
    answer, a real token at its real position that every later query sees; hiding it would
    make the answer's next tokens read a different text than the model wrote.
    """
    layout = np.isin(tokens, (config.ssep_id, config.pdep_id, config.pad_id))
    layout[num_prompt_tokens:] = False
    return layout


@dataclass
class _PromptRules:
    """What the span rules derive from a request's prompt alone, the same at every step of the
    request: kept per request (:data:`_PROMPTS`), so a decode step reads it instead of walking
    the whole prompt again (numpy over every prompt token, every step, for every span request).
    Checked by content: a request whose prompt differs from the kept one's (an id reused) gets
    its rules derived again."""

    prompt: np.ndarray  # the prompt's token ids (a copy)
    layout: np.ndarray  # [num_prompt] bool: rule 1's layout tokens
    sink: np.ndarray  # [num_prompt] bool: hidden runs (span sinks and head copies)
    rope_at: np.ndarray  # [num_prompt] int64: each token's position (layout: its would-be one)
    real: int  # real tokens in the prompt
    shift: int  # the positions' constant (sink length + gap when the prompt holds a sink)
    block_start: np.ndarray  # [prompt blocks] int64: block_segments of the prompt's blocks
    block_isolated: np.ndarray  # [prompt blocks] bool

    @classmethod
    def derive(cls, prompt: np.ndarray, config: SpanConfig, block_size: int) -> _PromptRules:
        layout = prompt_layout(prompt, prompt.shape[0], config)
        in_sink = span_sinks(prompt, block_size, config.ssep_id, config.sink_ids) >= 0
        index, length = span_hidden(prompt, block_size, config.ssep_id, config.pdep_id,
                                    config.pad_id, config.sink_ids, in_sink)
        sink = index >= 0
        gap = config.sink_gap
        shift = len(config.sink_ids) + gap if in_sink.any() else 0
        real = (~layout & ~sink).astype(np.int64)
        before = np.cumsum(real) - real  # real tokens before each token
        starts, isolated = block_segments(prompt[::block_size], config.ssep_id, config.pdep_id,
                                          block_size, prompt.shape[0])
        # a hidden run ends just before its span's first shown token (at before + shift), its
        # sink part ``sink_gap`` positions further back
        hidden_at = before + shift - length + index - np.where(in_sink, gap, 0)
        return cls(prompt=prompt.copy(), layout=layout, sink=sink,
                   rope_at=np.where(sink, hidden_at, before + shift),
                   real=int(real.sum()), shift=shift, block_start=starts,
                   block_isolated=isolated)


_PROMPTS: dict[str, _PromptRules] = {}  # by request id: the running span requests' rules


def _prompt_rules(req_id: str, prompt: np.ndarray, config: SpanConfig,
                  block_size: int) -> _PromptRules:
    rules = _PROMPTS.get(req_id)
    if rules is None or not np.array_equal(rules.prompt, prompt):
        rules = _PROMPTS[req_id] = _PromptRules.derive(prompt, config, block_size)
    return rules


def _row_view(rules: _PromptRules, seq_len: int, positions: np.ndarray,
              block_size: int) -> _RowView:
    """The span rules for one request's keys ``0 .. seq_len - 1`` and its queries at
    ``positions``, from its prompt's rules (``rules``).

    Every rule reads the prompt only: layout, sinks and segments (a generated SSEP at a block
    start opens no span); a generated token is a real token that attends to every real key
    before it, as the question does (``span_segments.query_segments``), so the prompt's rules
    extend to the generated tokens by arithmetic.

    Positions (rule 1 and the sink): a real token sits at the number of real tokens before it,
    plus one constant per request: the sink's length and ``SpanConfig.sink_gap`` when the
    request holds a sink, so that a span's sink, placed ``sink_gap`` positions before the
    span's first real token (where the span would follow the opening), never goes below 0. A
    span's hidden run (its sink, then the copy of a head computed in context before it:
    ``span_segments.span_hidden``) ends just before the span's first shown token, its sink
    part a further ``sink_gap`` positions before.
    """
    num_prompt = rules.prompt.shape[0]
    head = min(num_prompt, seq_len)
    generated = seq_len - head
    rope_at = np.concatenate([rules.rope_at[:head],
                              rules.real + rules.shift + np.arange(generated, dtype=np.int64)])
    layout = np.concatenate([rules.layout[:head], np.zeros(generated, dtype=bool)])
    sink = np.concatenate([rules.sink[:head], np.zeros(generated, dtype=bool)])
    blocks = -(-seq_len // block_size)
    more = max(blocks - rules.block_start.shape[0], 0)  # blocks a generated token starts
    starts = np.concatenate([rules.block_start[:blocks], np.zeros(more, dtype=np.int64)])
    isolated = np.concatenate([rules.block_isolated[:blocks], np.zeros(more, dtype=bool)])
    key_start, query_isolated = query_segments(starts, isolated, positions, block_size,
                                               num_prompt)
    return _RowView(key_start=key_start, query_shift=rope_at[positions] - positions,
                    key_positions=np.where(layout, -1, rope_at), sink=sink,
                    isolated=query_isolated)


def step_span_view(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> SpanView:
    """The :class:`SpanView` of the step being built (empty when no opted-in request of it
    holds a layout token).

    ``query_start_loc`` / ``seq_lens`` cover the step's requests in the runner's batch order.
    """
    runner = getattr(_STEP, "runner", None)
    expected: IsolatedStep | None = getattr(_STEP, "expected", None)
    if expected is not None:
        if runner is None:
            raise EngineIntegrationError(
                "minipic: attention metadata for a step with span-opted-in tokens was built "
                "outside GPUModelRunner._build_attention_metadata, so span isolation cannot "
                "apply (a model runner that bypasses the hook, e.g. vLLM's V2 runner: set "
                "VLLM_USE_V2_MODEL_RUNNER=0); the engine stops before answering")
        expected.builds += 1
    config: SpanConfig | None = _STATE["config"]
    view = SpanView()
    if runner is None or config is None:
        return view
    batch = runner.input_batch
    req_ids = batch.req_ids
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    holed = worker_positions.positions_with_holes(runner, query_start_loc, seq_lens)
    rows: dict[int, _RowView] = {}
    for gone in [r for r in _PROMPTS if r not in runner.requests]:  # finished, aborted
        del _PROMPTS[gone]
    for row, seq_len in enumerate(lens):
        if row >= len(req_ids) or req_ids[row] is None:
            continue
        state = runner.requests.get(req_ids[row])
        if state is None or not spans_opted_in(getattr(state, "sampling_params", None)):
            continue
        q_len = qsl[row + 1] - qsl[row]
        if q_len <= 0:
            continue
        num_prompt = int(batch.num_prompt_tokens[row])
        rules = _prompt_rules(req_ids[row], batch.token_ids_cpu[row, :num_prompt], config,
                              block_size)
        if not rules.layout[:seq_len].any():
            continue  # no layout token among its keys: no isolation, nothing to hide
        positions = (np.arange(seq_len - q_len, seq_len) if holed is None
                     else holed[qsl[row]:qsl[row + 1]].numpy())
        rows[row] = _row_view(rules, seq_len, positions, block_size)
    if not rows:
        return view
    num_tokens = qsl[-1]
    width = max(lens[r] for r in rows)
    view.key_start = torch.zeros(num_tokens, dtype=torch.int64)
    view.query_shift = torch.zeros(num_tokens, dtype=torch.int64)
    view.masked = torch.zeros(len(lens), dtype=torch.bool)
    view.key_positions = torch.zeros(len(lens), width, dtype=torch.int64)
    with_sinks = any(r.sink.any() for r in rows.values())
    view.query_isolated = torch.zeros(num_tokens, dtype=torch.bool)
    view.req_ids = [req_ids[r] if r in rows else None for r in range(len(lens))]
    if with_sinks:
        view.key_sink = torch.zeros(len(lens), width, dtype=torch.bool)
    for row, r in rows.items():
        view.key_start[qsl[row]:qsl[row + 1]] = torch.from_numpy(r.key_start)
        view.query_shift[qsl[row]:qsl[row + 1]] = torch.from_numpy(r.query_shift)
        view.masked[row] = True
        view.key_positions[row, :r.key_positions.size] = torch.from_numpy(r.key_positions)
        view.query_isolated[qsl[row]:qsl[row + 1]] = torch.from_numpy(r.isolated)
        if with_sinks:
            view.key_sink[row, :r.sink.size] = torch.from_numpy(r.sink)
    if not view.key_start.any():
        view.key_start = None
    return view
