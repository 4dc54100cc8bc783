"""Settings of the span store, shared by the launcher and the engine's KV connector.

Why in ``span_contract``: ``minipic serve``, ``Orchestrator.embedded`` and ``minipic index`` build
the setting; the KV connector (``engine_ext/span_store/connector.py``) reads it back from vLLM's
``kv_transfer_config``. Both must agree on the directories and on the model fingerprint, which
is computed here. The weights digest in it has its own module (``weights_digest.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from minipic.span_contract.env import SPAN_STORE_ENV
from minipic.span_contract.weights_digest import local_model_dir, weights_digest

CONNECTOR_NAME = "MinipicSpanStore"
# `minipic serve`'s default for --span-store: a directory, "off", or unset = on at
# ``default_store_dir()``
DEFAULT_ENV = SPAN_STORE_ENV
OFF_VALUES = ("off", "none", "0", "false")
CONNECTOR_MODULE = "minipic.engine_ext.span_store.connector"


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
    min_free_gib: float | None = Field(
        None, ge=0, description="writes pause before the disk's free space falls below this "
                                "(per tier folder); None = 5% of the disk, at most 1 GiB")
    group_access: bool = Field(
        False, description="files 0660 and folders 2770 of the group (replicas running as "
                           "different users of one group); default 0600 / 0700, private")
    group: str | None = Field(
        None, description="group access: the group (name or id) whose secret and folders are "
                          "trusted besides the user's own; None = the server's own group")
    read_threads: int = Field(4, ge=0, description="threads reading entries ahead of the step "
                                                   "(0: on the step's thread)")
    fill_mib_per_step: float = Field(64.0, gt=0, description="most entry bytes one step copies "
                                                             "into the pool")
    read_deadline_s: float = Field(2.0, gt=0, description="a read still running after this is "
                                                          "given up: the block is computed")
    probe_deadline_ms: float = Field(
        20.0, gt=0, description="an index miss is checked on the folder by one lstat off the "
                                "scheduler's thread, waited for at most this long")
    probe_budget_ms: float = Field(
        50.0, ge=0, description="most milliseconds per second the scheduler waits for such "
                                "checks (a slow mount spends it; 0: the index alone answers)")
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


# load formats whose weights are the model folder's files, which the weights digest reads; any
# other (tensorizer, ipc_cache, modelexpress, a plugin's) loads weights the store cannot name
_FOLDER_LOAD_FORMATS = ("auto", "hf", "pt", "safetensors", "npcache", "fastsafetensors",
                        "instanttensor", "mistral", "sharded_state", "runai_streamer",
                        "runai_streamer_sharded", "bitsandbytes", "gguf", "dummy")
# speculative methods whose drafter has no weights of its own (it proposes from the tokens or
# the target's hidden states); a custom proposer class is code the store cannot name
_WEIGHTLESS_DRAFTERS = ("ngram", "ngram_gpu", "suffix", "extract_hidden_states")


def _is_uri(name: Any) -> bool:
    return isinstance(name, str) and "://" in name


def _overrides_fact(overrides: Any) -> Any:
    """A dict as is; a callable by its qualified name, never ``repr`` (a memory address: another
    fingerprint in every process). A callable's effect cannot be named: ``unnamed_kv_inputs``
    turns the store off for it."""
    if isinstance(overrides, dict):
        return overrides
    if callable(overrides):
        return (f"callable {getattr(overrides, '__module__', '?')}."
                f"{getattr(overrides, '__qualname__', type(overrides).__qualname__)}")
    return repr(overrides)


def _config_digest(path: str, revision: str | None) -> str:
    """sha256 of a config read from outside the model folder (``--hf-config-path``): the file,
    or a folder's (a local hub snapshot's) ``.json`` and ``.py`` files; "" when not found."""
    file = Path(path).expanduser()
    root = None if file.is_file() else local_model_dir(path, revision)
    files = [file] if file.is_file() else [] if root is None else sorted(
        p for p in root.glob("*") if p.is_file() and p.suffix in (".json", ".py"))
    if not files:
        return ""
    digest = hashlib.sha256()
    for item in files:
        digest.update(item.name.encode() + b"\0" + item.read_bytes())
    return digest.hexdigest()[:32]


def _config_source_facts(model: Any) -> dict[str, Any]:
    """Where the model's config was read from and in which format (``--hf-config-path``,
    ``--config-format``): a config from outside the hashed folder, named by its bytes."""
    path = getattr(model, "hf_config_path", None)
    fmt = getattr(model, "config_format", "auto")
    external = bool(path) and str(path) != str(model.model)
    revision = getattr(model, "_hf_config_revision", None) or model.revision
    return {"hf_config_path": path, "config_format": str(getattr(fmt, "value", fmt)),
            "config_digest": _config_digest(str(path), revision) if external else None}


def _drafter_facts(vllm_config: Any, digest_of: Callable[..., str]) -> dict[str, Any] | None:
    """The speculative-decoding drafter: its method, model, revision, number of tokens and
    weights (a drafter's attention layers keep KV of their own, saved with the block's pages).
    ``weights``: None for a drafter without weights, "target" for the target's own layers (MTP),
    else the digest of its folder ("" when it cannot be found: the store is off)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    draft = getattr(spec, "draft_model_config", None)
    target = vllm_config.model_config
    method = str(getattr(spec, "method", None))
    facts: dict[str, Any] = {
        "method": method, "model": getattr(spec, "model", None),
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
        "revision": getattr(draft, "revision", None),
        "quantization": getattr(draft, "quantization", None), "weights": None}
    if method in _WEIGHTLESS_DRAFTERS or draft is None:
        return facts
    if str(draft.model) == str(target.model) and draft.revision == target.revision:
        facts["weights"] = "target"
    elif _is_uri(draft.model) or _is_uri(getattr(draft, "model_weights", "")):
        facts["weights"] = ""
    else:
        facts["weights"] = digest_of(str(draft.model), draft.revision)
    return facts


def unnamed_kv_inputs(vllm_config: Any, digest_of: Callable[..., str] = weights_digest
                      ) -> str | None:
    """Why this configuration's KV depends on something the fingerprint cannot name (the
    store must then be off: the connector logs this and serves without it), or None.

    Refused rather than named: weights loaded from elsewhere than the model folder (a load
    format such as tensorizer, or a URI: the digest would name the folder's files, not what
    was loaded), a callable ``hf_overrides`` (code: a qualified name does not say what it does,
    and a source hash misses its closure), an external config or drafter whose files cannot
    be found, and a custom proposer class."""
    model = vllm_config.model_config
    load = vllm_config.load_config
    fmt = str(getattr(load, "load_format", "auto")).lower()
    if fmt not in _FOLDER_LOAD_FORMATS:
        return (f"--load-format {fmt} loads weights from elsewhere than the model folder: "
                f"weights the store cannot name")
    for name in (model.model, getattr(model, "model_weights", None)):
        if _is_uri(name):
            return f"weights streamed from {name}: weights the store cannot name"
    if getattr(load, "download_dir", None) and not Path(str(model.model)).is_dir():
        return ("--download-dir: the hub id's weights are loaded from a folder the weights "
                "digest does not read")
    if callable(model.hf_overrides):
        return ("a callable hf_overrides: code the store cannot name (pass a dict of "
                "overrides to use the store)")
    source = _config_source_facts(model)
    if source["config_digest"] == "":
        return f"--hf-config-path {source['hf_config_path']}: the config cannot be found to name"
    drafter = _drafter_facts(vllm_config, digest_of)
    if drafter is not None and drafter["method"] == "custom_class":
        return "a custom speculative proposer class: code the store cannot name"
    if drafter is not None and drafter["weights"] == "":
        return (f"the speculative drafter {drafter['model']}: its weights cannot be found to "
                f"name them")
    return None


def fingerprint_facts(vllm_config: Any, weights_digest: str, span_config: Any, *,
                      digest_of: Callable[..., str] = weights_digest) -> dict[str, Any]:
    """Everything a stored block's KV bytes depend on besides its tokens, by name: the
    weights' content and revision, how they were loaded, overrides, quantization, dtype, block
    size, rotary config, the KV page layout, span ids, the libraries and compilation that
    compute the KV, the config's source and format, the speculative drafter, and minipic's
    engine code (any change: another key). ``digest_of`` hashes a drafter's weights (the
    engine passes its own cache's). ``unnamed_kv_inputs`` says what cannot be named here.
    ``docs/span_store.md`` lists vLLM's settings that are not here and why they do not change
    KV."""
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
        "hf_overrides": _overrides_fact(overrides),
        "config_source": _config_source_facts(model),
        "drafter": _drafter_facts(vllm_config, digest_of),
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


def config_fingerprint(vllm_config: Any, weights_digest: str, span_config: Any, *,
                       digest_of: Callable[..., str] = weights_digest) -> str:
    """Digest of ``fingerprint_facts`` (the same in every process of one configuration)."""
    facts = fingerprint_facts(vllm_config, weights_digest, span_config, digest_of=digest_of)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=repr).encode()
                          ).hexdigest()[:32]
