"""KV memory in use, watched from inside an embedded engine's own step statistics.

Why a stat logger: vLLM's scheduler reports ``kv_cache_usage`` (the fraction of KV blocks held by
requests) with every engine step's outputs; a stat logger passed to ``AsyncLLM`` receives every
one of those reports in this process, so a benchmark can read the peak and mean over exactly the
interval it measures, with no polling and nothing added to the engine. Blocks held only by the
prefix cache (evictable) count as free in that fraction, as vLLM counts them.

Bytes: a block holds ``block_size`` tokens of every attention layer, ``2 * head_size`` elements
per token and kv head (K and V) with or without minipic: the position-free backend keeps vLLM's
stock page (``engine_ext.attention.cpu_backend``: keys stored once, rotated at their home slot).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, computed_field

MIB = 1 << 20


class KVUsage(BaseModel):
    """Peak and mean KV blocks in use over an interval (``KVUsageMonitor.snapshot``)."""

    blocks_total: int
    block_bytes: int
    peak_blocks: int
    mean_blocks: float
    samples: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def peak_mib(self) -> float:
        return self.peak_blocks * self.block_bytes / MIB

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mean_mib(self) -> float:
        return self.mean_blocks * self.block_bytes / MIB

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_mib(self) -> float:
        return self.blocks_total * self.block_bytes / MIB


def kv_block_bytes(vllm_config: Any) -> int:
    """Bytes of one KV block over all attention layers, from the model config.

    The same with and without the position-free backend: it keeps vLLM's stock page (keys
    stored once, rotated at their home slot; ``engine_ext/attention/cpu_backend.py``).
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    itemsize = model.dtype.itemsize if vllm_config.cache_config.cache_dtype == "auto" else 1
    cell = 2 * model.get_head_size()  # K and V
    return (layers * vllm_config.cache_config.block_size * model.get_num_kv_heads(parallel)
            * cell * itemsize)


class KVUsageMonitor:
    """Keeps the peak and mean of the engine's KV usage since the last ``reset``."""

    def __init__(self, position_free: bool) -> None:
        self.position_free = position_free
        self.blocks_total = 0
        self.block_bytes = 0
        self.reset()

    def reset(self) -> None:
        self._peak = 0.0
        self._sum = 0.0
        self._samples = 0

    def record(self, usage: float) -> None:
        self._peak = max(self._peak, usage)
        self._sum += usage
        self._samples += 1

    def snapshot(self) -> KVUsage:
        mean = self._sum / self._samples if self._samples else 0.0
        return KVUsage(blocks_total=self.blocks_total, block_bytes=self.block_bytes,
                       peak_blocks=round(self._peak * self.blocks_total),
                       mean_blocks=mean * self.blocks_total, samples=self._samples)

    def stat_logger_factory(self) -> Any:
        """A per-engine stat-logger factory for ``AsyncLLM(stat_loggers=[...])``."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        monitor = self

        class _KVUsageLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.vllm_config = vllm_config
                monitor.block_bytes = kv_block_bytes(vllm_config)

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    monitor.record(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self) -> None:
                # num_gpu_blocks is known only once the engine has sized its cache
                monitor.blocks_total = self.vllm_config.cache_config.num_gpu_blocks or 0

        return _KVUsageLogger
