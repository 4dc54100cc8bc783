"""Worker side of a step with several holes per request: each hole token at its true position.

The scheduler (``engine_ext/holes/scheduler_steps.py``) sends, for a request whose step computes
several holes, ``num_computed_tokens = E - N`` (``E`` the last hole's end, ``N`` its scheduled hole
tokens) and the holes themselves on the scheduler output (``HOLES_ATTR``). vLLM's runner
(``GPUModelRunner._prepare_inputs``, inherited by the CPU runner) derives everything of a token
from ``num_computed_tokens[row] + query_pos[t]``: the input id it gathers, the model's
``positions`` (query rotation), the slot mapping (where its K/V is written). ``query_pos`` comes
from ``_get_cumsum_and_arange``, called once at the top of ``_prepare_inputs``; we rewrite the
holed rows' ``query_pos`` right there to ``hole position - (E - N)``, so every one of those
derived values is the hole token's own. Sequence length (``E``), logits row (the last hole's
last token) and the discard mask need no change.

The attention backends need the positions too (their stock formula assumes one window per
row): :func:`positions_with_holes` gives them from the same holes, and
``engine_ext/attention/step_plan.py`` runs one kernel row per hole.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from minipic.engine_ext.vllm_surface.added_names import (
    HOLES_ATTR,
    PENDING_HOLES_ATTR,
    STEP_HOLES_ATTR,
)
from minipic.span_contract.errors import EngineIntegrationError

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def _wrap_prepare_inputs(stock: Any) -> Any:
    @functools.wraps(stock)
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        holes = getattr(scheduler_output, HOLES_ATTR, None)
        self.__dict__[STEP_HOLES_ATTR] = None
        self.__dict__[PENDING_HOLES_ATTR] = holes or None
        try:
            return stock(self, scheduler_output, *args, **kwargs)
        finally:
            self.__dict__[PENDING_HOLES_ATTR] = None

    return _prepare_inputs


def _wrap_get_cumsum_and_arange(stock: Any) -> Any:
    @functools.wraps(stock)
    def _get_cumsum_and_arange(self: Any, num_tokens: np.ndarray, arange_out: np.ndarray,
                               *args: Any, **kwargs: Any) -> np.ndarray:
        cu = stock(self, num_tokens, arange_out, *args, **kwargs)
        holes = self.__dict__.get(PENDING_HOLES_ATTR)
        if holes and arange_out is self.query_pos.np:
            self.__dict__[PENDING_HOLES_ATTR] = None  # the first call of the step only
            self.__dict__[STEP_HOLES_ATTR] = (int(cu[-1]) if len(cu) else 0,
                                        _rewrite_query_pos(self, holes, cu, arange_out))
        return cu

    return _get_cumsum_and_arange


def _rewrite_query_pos(runner: Any, holes: dict[str, Any], cu: np.ndarray,
                       query_pos: np.ndarray) -> dict[int, Any]:
    """``query_pos`` of each holed row := hole position - the row's computed tokens."""
    batch = runner.input_batch
    rows: dict[int, Any] = {}
    for rid, spans in holes.items():
        row = batch.req_id_to_index.get(rid)
        if row is None:
            raise EngineIntegrationError(f"minipic: holed request {rid} is not in the batch")
        start = int(cu[row - 1]) if row else 0
        positions = np.concatenate([np.arange(s, s + n) for s, n in spans])
        count = int(cu[row]) - start
        computed = int(batch.num_computed_tokens_cpu[row])
        if positions.size != count or int(positions[-1]) != computed + count - 1:
            raise EngineIntegrationError(
                f"minipic: request {rid}'s holes {spans} do not match its step ({count} "
                f"tokens after {computed} computed); the engine stops rather than misplace "
                "tokens")
        query_pos[start:start + count] = positions - computed
        rows[row] = spans
    return rows


def factories() -> dict[str, Any]:
    """The runner's wrappers, for ``patches.apply("holes", ...)``."""
    return {
        f"{RUNNER}._prepare_inputs": _wrap_prepare_inputs,
        f"{RUNNER}._get_cumsum_and_arange": _wrap_get_cumsum_and_arange,
    }


def positions_with_holes(runner: Any, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
                   ) -> torch.Tensor | None:
    """Logical position of every token of the runner's current step (int64, host), or None
    when no request of it has several holes (positions are then ``seq_len - q_len + t``).

    ``query_start_loc`` / ``seq_lens`` cover the step's requests in the runner's batch order.
    """
    step = runner.__dict__.get(STEP_HOLES_ATTR) if runner is not None else None
    if not step:
        return None
    total, rows = step
    qsl = query_start_loc.tolist()
    if not rows or qsl[-1] != total:
        return None  # not the step the holes were sent for (a dummy run)
    lens = seq_lens.tolist()
    parts = []
    for row, seq_len in enumerate(lens):
        count = qsl[row + 1] - qsl[row]
        spans = rows.get(row)
        if spans is None:
            parts.append(torch.arange(seq_len - count, seq_len))
        else:
            parts.append(torch.cat([torch.arange(s, s + n) for s, n in spans]))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
