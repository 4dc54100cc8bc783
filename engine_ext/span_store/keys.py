"""What a span-store entry is stored under: block hash + a fingerprint of everything else.

A span block's hash (``engine_ext/span_hashing.py``) names its tokens, its span chain, the
tenant's ``cache_salt`` and LoRA keys -- everything its KV depends on *inside one engine*. Outside
the engine the same hash could have been computed by other weights, another dtype or block
size, other SSEP/PDEP ids, or another page layout (the CPU kernel packs pages per ISA). The
config fingerprint names those; entries carry it in their header (a foreign entry is never
read) and the key mixes it with the block hash and vLLM's root hash ``NONE_HASH`` (random per
process for non-cryptographic hash functions without ``PYTHONHASHSEED``: then entries of another
process are simply never found).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Bump when what a payload holds changes (page layout, what "home" means, the header).
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


def config_fingerprint(vllm_config: Any, weights_digest: str, span_config: Any) -> str:
    """Digest of what a block's KV depends on besides its tokens (same in every process)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    facts = {
        "layout_version": LAYOUT_VERSION,
        "weights": weights_digest,
        "architecture": list(getattr(model.hf_config, "architectures", None) or []),
        "dtype": str(model.dtype),
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
        "block_size": vllm_config.cache_config.block_size,
        "layers": model.get_num_layers_by_block_type(parallel, "attention"),
        "kv_heads": model.get_num_kv_heads(parallel),
        "head_size": model.get_head_size(),
        "tensor_parallel": [parallel.tensor_parallel_size, parallel.rank],
        "span_config": span_config.model_dump() if span_config is not None else None,
        "hash_algo": vllm_config.cache_config.prefix_caching_hash_algo,
        "page": page_layout(vllm_config),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def entry_key(fingerprint: str, block_hash: bytes) -> str:
    """Store key of one block: its hash, the config fingerprint and the engine's root hash."""
    from vllm.v1.core import kv_cache_utils as kcu

    digest = hashlib.blake2b(digest_size=20)
    digest.update(fingerprint.encode())
    digest.update(bytes(kcu.NONE_HASH or b""))
    digest.update(bytes(block_hash))
    return digest.hexdigest()
