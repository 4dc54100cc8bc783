"""Settings of the span store, shared by the launcher and the engine's KV connector.

Why in ``span_contract``: ``minipic serve``, ``Orchestrator.embedded`` and ``minipic index`` build
the setting; the KV connector (``engine_ext/span_store/connector.py``) reads it back from vLLM's
``kv_transfer_config``. Both must agree on the directories and on the model fingerprint, which
is computed here, once, in the launching process (hashing the weights in every engine process
would cost seconds each).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from minipic.span_contract.env import SPAN_STORE_ENV

CONNECTOR_NAME = "MinipicSpanStore"
# `minipic serve`'s default for --span-store: a directory, "off", or unset = on at
# ``default_store_dir()``
DEFAULT_ENV = SPAN_STORE_ENV
OFF_VALUES = ("off", "none", "0", "false")
CONNECTOR_MODULE = "minipic.engine_ext.span_store.connector"
_DIGEST_CACHE = "weights-digests.json"
# what a model folder's KV depends on: weights, configs, tokenizer models, and the modeling code
# a ``trust_remote_code`` model brings in ``.py`` files
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".gguf", ".py")


class SpanStoreConfig(BaseModel):
    """Where span KV lives outside the engine, and how much of it.

    ``dir``: the local persistent tier (bounded, evicts, crash-safe); None keeps only RAM.
    ``shared_dir``: a tier every replica reads and writes (several replicas or nodes on one
    shared mount); None for a single engine.
    """

    dir: str | None = Field(None, description="local disk tier; None = RAM only")
    ram_mib: int = Field(256, ge=0, description="host-RAM LRU in front of the disk tiers")
    disk_gib: float = Field(8.0, gt=0, description="bound of the local disk tier")
    shared_dir: str | None = Field(None, description="tier shared by replicas; None = none")
    shared_gib: float = Field(32.0, gt=0, description="bound of the shared tier")
    group_access: bool = Field(
        False, description="entries 0640 and folders 0750 (replicas of one group on a shared "
                           "mount); default 0600 / 0700, private to the user")
    group: str | None = Field(
        None, description="group access: the group (name or id) whose secret and folders are "
                          "trusted besides the user's own; None = the server's own group")
    read_threads: int = Field(4, ge=0, description="threads reading entries ahead of the step "
                                                   "(0: on the step's thread)")
    fill_mib_per_step: float = Field(64.0, gt=0, description="most entry bytes one step copies "
                                                             "into the pool")
    read_deadline_s: float = Field(2.0, gt=0, description="a read still running after this is "
                                                          "given up: the block is computed")
    weights_digest: str = Field("", description="filled by resolved(): the model's weights")
    weights_of: str = Field("", description="the model and revision weights_digest is of")

    def resolved(self, model: str, revision: str | None = None) -> SpanStoreConfig:
        """Absolute directories and the weights digest of ``model`` at ``revision``."""
        def absolute(path: str | None) -> str | None:
            return None if path is None else str(Path(path).expanduser().resolve())

        of = weights_identity(model, revision)
        digest = self.weights_digest if self.weights_of == of else ""
        return self.model_copy(update={
            "dir": absolute(self.dir), "shared_dir": absolute(self.shared_dir),
            "weights_digest": digest or weights_digest(model, revision), "weights_of": of})

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config``: minipic's connector, by module path (vLLM's
        extension point for out-of-tree connectors), with these settings."""
        return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both", "kv_connector_extra_config": self.model_dump()}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> SpanStoreConfig:
        return cls.model_validate({k: v for k, v in extra.items() if k in cls.model_fields})


def default_store_dir() -> Path:
    """Where ``minipic serve`` and ``minipic index`` keep the store unless told otherwise: next to
    the converted models (``$MINIPIC_CACHE_DIR`` or ``~/.cache/minipic``), so that a server
    started again finds what an earlier one (or ``minipic index``) saved."""
    from minipic.span_contract.models import cache_root

    return cache_root() / "span-store"


def weights_identity(model: str, revision: str | None) -> str:
    """What a weights digest was computed for (the engine checks it against its own model)."""
    return f"{model}@{revision or ''}"


def local_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The folder holding ``model``'s files: the folder itself, or the local Hugging Face
    snapshot of a hub id at ``revision`` (never a download). None when there is none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 (not a hub id, not cached, no hub library: unknown)
        return None


def weights_digest(model: str, revision: str | None = None) -> str:
    """sha256 over the model's weight and config files, cached by (path, size, mtime); "" when
    the files cannot be found (a hub id not downloaded yet), which means no store.

    The store must never serve KV computed by other weights under the same block hash, and the
    hash does not name the weights; their digest goes into every key. A name is not a digest:
    the same hub id or folder can hold other weights tomorrow. Hashing a 270 MB model takes
    about a second, once: the result is kept next to the minipic cache.
    """
    root = local_model_dir(model, revision)
    if root is None:
        return ""
    files = sorted(p for p in root.glob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not any(p.suffix != ".json" for p in files):
        return ""  # no weights here: nothing to name
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    cache = _digest_cache_path()
    known: dict[str, Any] = {}
    if cache is not None and cache.exists():
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
    entry = known.get(str(root.resolve()))
    if entry and entry.get("stamp") == [list(s) for s in stamp]:
        return str(entry["digest"])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()[:32]
    if cache is not None:
        known[str(root.resolve())] = {"stamp": stamp, "digest": value}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            pass  # a cache only: the digest is recomputed next time
    return value


def _digest_cache_path() -> Path | None:
    try:
        from minipic.span_contract.models import cache_root

        return cache_root() / _DIGEST_CACHE
    except Exception:  # noqa: BLE001 (no writable cache: compute every time)
        return None


# Bump when what a payload holds changes (page layout, what "home" means, the header). The
# engine code hash in the fingerprint changes with any engine-side edit as well; this names
# the payload format for people reading a fingerprint's inputs.
LAYOUT_VERSION = "minipic-span-page-2"


def page_layout(vllm_config: Any) -> str:
    """The KV page format this engine writes: platform, and on CPU the kernel's ISA packing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"{current_platform.device_name}:unrotated-keys"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return "cpu:home-rotated:" + _get_attn_isa(model.dtype, vllm_config.cache_config.block_size,
                                               model.get_head_size())


def _rotary_facts(model_config: Any) -> dict[str, Any]:
    """The rotary settings the keys were computed with, after ``--hf-overrides``."""
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    return {name: getattr(text, name, None) for name in (
        "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "max_position_embeddings", "original_max_position_embeddings")}


def _scaled_rotary(rotary: dict[str, Any]) -> bool:
    """Whether RoPE is scaled (YaRN, dynamic NTK, ...): some scalings depend on the served
    context length."""
    params = rotary.get("rope_scaling") or rotary.get("rope_parameters")
    if not isinstance(params, dict):
        return False
    return (params.get("rope_type") or params.get("type")) not in (None, "default")


def _loading_facts(vllm_config: Any) -> dict[str, Any]:
    """How vLLM turned the files into weights: the same folder gives other weights with
    ``--load-format dummy`` (random), another format, loader options or ignored files."""
    load = vllm_config.load_config
    extra = getattr(load, "model_loader_extra_config", None)
    return {"load_format": str(getattr(load, "load_format", "auto")),
            "loader_extra": extra if isinstance(extra, dict) else repr(extra),
            "ignore_patterns": repr(getattr(load, "ignore_patterns", None))}


def _compute_facts(vllm_config: Any) -> dict[str, Any]:
    """What computes the KV besides the weights: the libraries' versions (kernels and their
    numerics change between releases), the model implementation, and compilation (a compiled
    graph may fuse and reorder float operations the eager path does not)."""
    import torch
    import vllm

    model = vllm_config.model_config
    compilation = vllm_config.compilation_config
    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "model_impl": str(getattr(model, "model_impl", "")),
            "trust_remote_code": bool(getattr(model, "trust_remote_code", False)),
            "code_revision": getattr(model, "code_revision", None),
            "enforce_eager": bool(model.enforce_eager),
            "compilation_mode": str(getattr(compilation, "mode", "")),
            "custom_ops": list(getattr(compilation, "custom_ops", None) or []),
            "calculate_kv_scales": bool(getattr(vllm_config.cache_config,
                                                "calculate_kv_scales", False))}


def fingerprint_facts(vllm_config: Any, weights_digest: str, span_config: Any) -> dict[str, Any]:
    """Everything a stored block's KV bytes depend on besides its tokens, by name: the
    weights' content and revision, how they were loaded, overrides, quantization, dtype, block
    size, rotary config, the KV page layout, span ids, the libraries and compilation that
    compute the KV, and minipic's engine code (any change: another key). ``docs/span_store.md``
    lists vLLM's settings that are not here and why they do not change KV."""
    from minipic.span_contract.engine_config import plugin_code_hash

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    overrides = model.hf_overrides
    rotary = _rotary_facts(model)
    return {
        "layout_version": LAYOUT_VERSION,
        "engine_code": plugin_code_hash(),
        "weights": weights_digest,
        "loading": _loading_facts(vllm_config),
        "compute": _compute_facts(vllm_config),
        # dynamic rotary scaling depends on the context length the engine serves
        "max_model_len": model.max_model_len if _scaled_rotary(rotary) else None,
        "revision": model.revision,
        "hf_overrides": overrides if isinstance(overrides, dict) else repr(overrides),
        "quantization": model.quantization,
        "rotary": rotary,
        "architecture": list(getattr(model.hf_config, "architectures", None) or []),
        "dtype": str(model.dtype),
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
        "block_size": vllm_config.cache_config.block_size,
        "layers": model.get_num_layers_by_block_type(parallel, "attention"),
        "kv_heads": model.get_num_kv_heads(parallel),
        "head_size": model.get_head_size(),
        "tensor_parallel": parallel.tensor_parallel_size,
        "span_config": span_config.model_dump() if span_config is not None else None,
        "hash_algo": vllm_config.cache_config.prefix_caching_hash_algo,
        "page": page_layout(vllm_config),
    }


def config_fingerprint(vllm_config: Any, weights_digest: str, span_config: Any) -> str:
    """Digest of ``fingerprint_facts`` (the same in every process of one configuration)."""
    facts = fingerprint_facts(vllm_config, weights_digest, span_config)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=repr).encode()
                          ).hexdigest()[:32]
