"""Span isolation in the worker: the first key each query of a step may attend to.

Attention metadata (``CommonAttentionMetadata``) carries lengths and block tables but no token
ids, while the isolation rule (``engine_ext/attention/span_segments.py``) is a function of the
tokens at block starts — including blocks that were cached, not computed, in this step. The model
runner has them all: its persistent batch keeps every request's tokens
(``input_batch.token_ids_cpu``, row ``r`` = the step's request ``r``) and its request states keep
the sampling params that say whether a request opted in to span semantics.

So we wrap ``GPUModelRunner._build_attention_metadata`` (the CPU runner inherits it) to note
which runner is building metadata; a position-free metadata builder then asks
:func:`step_key_starts` for the step's per-token ``key_start`` while it builds. Outside that call
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

from minipic.engine_ext.attention.span_segments import block_key_starts
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


def step_key_starts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int) -> torch.Tensor | None:
    """``key_start`` per query token of the step being built (int64), or None if no token of
    the step is isolated (no opted-in request reads an SSEP-led segment) — the stock fast path.

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
    if runner is None or config is None:
        return None
    batch = runner.input_batch
    req_ids = batch.req_ids
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out: torch.Tensor | None = None
    holed = worker_positions.positions_with_holes(runner, query_start_loc, seq_lens)
    for row, seq_len in enumerate(lens):
        if row >= len(req_ids) or req_ids[row] is None:
            continue
        state = runner.requests.get(req_ids[row])
        if state is None or not spans_opted_in(getattr(state, "sampling_params", None)):
            continue
        q_len = qsl[row + 1] - qsl[row]
        if q_len <= 0:
            continue
        firsts = batch.token_ids_cpu[row, :seq_len:block_size]
        if not (firsts == config.ssep_id).any():
            continue
        starts = block_key_starts(firsts, config.ssep_id, config.pdep_id, block_size)
        positions = (np.arange(seq_len - q_len, seq_len) if holed is None
                     else holed[qsl[row]:qsl[row + 1]].numpy())
        token_starts = starts[positions // block_size]
        if not token_starts.any():
            continue
        if out is None:
            out = torch.zeros(qsl[-1], dtype=torch.int64)
        out[qsl[row]:qsl[row + 1]] = torch.from_numpy(token_starts)
    return out
