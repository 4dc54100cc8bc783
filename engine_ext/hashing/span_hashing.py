"""Where the block hash is changed: SSEP / PDEP aware block hashing for vLLM's prefix cache.

vLLM hashes full KV blocks in a chain, ``h_i = H(h_{i-1}, x_i, extra_i)``, so a block hits only
when everything before it is identical ("each hash chains over the full prefix", the invariant
stated in ``vllm/v1/core/kv_cache_utils.py``). MiniPIC bends that invariant on purpose, keyed on
the first token of a block:

* **SSEP** (span separator) — ``h_i = H(h_0, x_i, extra_i)``. The chain restarts, so a span's
  blocks hash the same whatever precedes them; the final prompt finds a span that was warmed
  alone (its *span prefill*) at any offset. The attention backend makes that reuse correct by
  rotating keys at their new positions (see ``engine_ext/attention/cpu_backend.py``).
* **PDEP** (prompt dependent) — ``h_i = H(g_{i-1}, x_i, extra_i + PDEP_TAG)`` where ``g`` is the
  ordinary full-prefix chain, i.e. the hash covers ``x_{<=i}``. A question block therefore only
  hits when the whole prompt before it is equal — never because an unrelated prompt happened to
  end with the same span.
* anything else chains on from the previous block as usual, except that
* a block of the stock chain that holds a layout token (SSEP, PDEP, PAD: the system prompt's
  padding) leaves it: ``h_i = H(h_{i-1}, x_i, extra_i + LAYOUT_TAG)``, and every SSEP-led block
  carries ``LAYOUT_TAG`` too. Under rule 1 (docs/design.md §2) an opted-in request's layout tokens
  are invisible, so such a block's KV differs from what a plain request computes for the same
  tokens; without the tag a plain request starting with those tokens would hit it.

``g`` (the stock full-prefix chain) is kept next to the MiniPIC chain on the request, because PDEP
needs it and because it is exactly what vLLM would have computed.

Tenant isolation: vLLM puts ``cache_salt`` into the extra keys of block 0 only and relies on the
chain to carry it. A chain reset would drop it, letting tenants share spans. So every SSEP and
PDEP block gets the salt in its extra keys; LoRA and multimodal keys are already per block.

Blocks with no special token at their start hash exactly as in stock vLLM, so a prompt without
SSEP/PDEP gets the stock hashes (PIC off == stock vLLM).

**Markers are prompt tokens** (docs/design.md §2). The client lays out the prompt, never the
answer, so every rule above reads the prompt only: a block whose first token the model generated
is never an SSEP or PDEP block, and a generated PAD / SSEP / PDEP is a real token (the worker
neither hides it nor isolates anything after it, ``engine_ext/attention/span_segments.py``).
Otherwise a decoded SSEP at a block start would restart the chain, and a decoded block be cached
under a span-local hash, as if it were a span anyone could reuse at any offset. vLLM hashes the
blocks it decodes too, so two more cases keep a hash naming its block's KV:

* a block holding generated tokens inside an SSEP-led segment (a prompt that ended inside a
  span): generated tokens attend to every real key of the prompt, not only the span's, so its
  hash is ``H(g_{i-1}, x_i, extra_i + DECODED_TAG + (split,))``: the whole prefix, and where
  generation began in the block (the tokens before it are the span's, isolated). So are the
  blocks after it. Such blocks are no span blocks (:func:`span_chained_blocks`);
* a generated token with a layout id is real there but hidden when the same tokens come back as
  a prompt (a next turn), so a block holding one carries ``REAL_LAYOUT_TAG`` and the offsets of
  those tokens, wherever the chain has left the stock one. Generated blocks without layout ids
  hash as the same tokens would in a prompt, so a next turn still hits them.

Opt-in: only a request that asked for span semantics (``extra_args["minipic_spans"]``, see
``span_contract.span_config.spans_opted_in``) gets SSEP/PDEP hashing; any other request gets the
stock chain for every block, whatever its tokens are — a plain client whose text happens to
encode to the marker ids must not share KV with span requests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import FULL_CHAIN_ATTR
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import SpanConfig, spans_opted_in

PDEP_TAG = ("minipic", "pdep")
LAYOUT_TAG = ("minipic", "layout")
DECODED_TAG = ("minipic", "decoded")  # + the index in the block of its first generated token
REAL_LAYOUT_TAG = ("minipic", "real_layout")  # + the offsets of generated layout ids


def prompt_length(request: Any) -> int:
    """How many of ``request.all_token_ids`` are prompt (the rest the model generated).

    ``prompt_token_ids`` first: vLLM's streaming-input update extends it (the kept output
    becomes prompt) and rehashes before it sets ``num_prompt_tokens``.
    """
    prompt = getattr(request, "prompt_token_ids", None)
    return len(prompt) if prompt is not None else request.num_prompt_tokens


def _segment_marker(token_ids: Any, block_index: int, block_size: int, num_prompt: int,
                    markers: tuple[int, int]) -> int | None:
    """The marker (SSEP or PDEP id) leading the segment of block ``block_index``: the first
    token of the last block at or before it that starts inside the prompt with a marker
    (None: no marker so far)."""
    last = min(block_index, (num_prompt - 1) // block_size)
    for index in range(last, -1, -1):
        first = token_ids[index * block_size]
        if first in markers:
            return first
    return None


def _with_salt(request: Any, extra_keys: tuple | None, start_token_idx: int) -> tuple | None:
    """Extra keys of a chain-reset block: the salt must be there even when it is not block 0.

    The salt goes where vLLM puts it on block 0 (after LoRA and multimodal keys, before
    prompt-embeds keys), so a span warmed alone at offset 0 and the same span at offset k under
    the same salt hash identically.
    """
    salt = getattr(request, "cache_salt", None)
    if not salt or start_token_idx == 0:  # block 0 already carries it (stock behaviour)
        return extra_keys
    keys = list(extra_keys or ())
    at = next((i for i, key in enumerate(keys) if key[0] == "prompt_embeds"), len(keys))
    keys.insert(at, ("cache_salt", salt))
    return tuple(keys)


def _full_chain_matching(request: Any, hash_block_size: int,
                         caching_hash_fn: Callable[[Any], bytes]) -> list[bytes]:
    """The request's stock chain, exactly as long as ``request.block_hashes``.

    vLLM truncates or resets ``block_hashes`` when a request's tokens change under it (a
    streaming-input session update, a multi-turn continuation) and then asks the hasher for the
    blocks again. The stock chain kept next to it must be cut to the same length, or the next
    block would chain onto a parent that no longer names its prefix: lost hits for plain
    requests, and a PDEP block hashed over a stale prefix (a false hit) for opted-in ones.
    If the chain is shorter (``block_hashes`` set from outside the hasher), it is rebuilt from
    the request's tokens, which is what stock vLLM's chain is by definition.
    """
    from vllm.v1.core import kv_cache_utils as kcu

    full_chain: list[bytes] = request.__dict__.setdefault(FULL_CHAIN_ATTR, [])
    num_blocks = len(request.block_hashes)
    del full_chain[num_blocks:]
    if len(full_chain) < num_blocks:
        full_chain.clear()
        token_ids, mm_idx, parent = request.all_token_ids, 0, None
        for start in range(0, num_blocks * hash_block_size, hash_block_size):
            end = start + hash_block_size
            extra, mm_idx = kcu.generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = kcu.hash_block_tokens(caching_hash_fn, parent, token_ids[start:end], extra)
            full_chain.append(parent)
    return full_chain


def make_span_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    config: SpanConfig,
) -> Callable[[Any], list[bytes]]:
    """A drop-in for vLLM's ``get_request_block_hasher`` closure, aware of SSEP / PDEP."""
    from vllm.v1.core import kv_cache_utils as kcu

    ssep, pdep = config.ssep_id, config.pdep_id
    layout = frozenset((config.ssep_id, config.pdep_id, config.pad_id))

    def request_block_hasher(request: Any) -> list[bytes]:
        start = len(request.block_hashes) * hash_block_size
        num_tokens = request.num_tokens
        if start + hash_block_size > num_tokens:
            return []
        full_chain = _full_chain_matching(request, hash_block_size, caching_hash_fn)
        prev_pic = request.block_hashes[-1] if request.block_hashes else None
        prev_full = full_chain[-1] if full_chain else None
        token_ids = request.all_token_ids
        span_semantics = spans_opted_in(getattr(request, "sampling_params", None))
        # markers and layout are prompt tokens only (module docstring)
        num_prompt = prompt_length(request)
        segment = _segment_marker(token_ids, start // hash_block_size - 1, hash_block_size,
                                  num_prompt, (ssep, pdep)) if span_semantics else None
        mm_idx = 0
        if start > 0 and request.mm_features:
            mm_idx, _ = kcu.get_mm_features_in_window(
                request.mm_features, start, start + hash_block_size
            )
        new_hashes: list[bytes] = []
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            extra, mm_idx = kcu.generate_block_hash_extra_keys(request, start, end, mm_idx)
            block = token_ids[start:end]
            full = kcu.hash_block_tokens(caching_hash_fn, prev_full, block, extra)
            split = max(num_prompt - start, 0)  # the block's first generated token (if < bs)
            # a generated first token is no marker
            first = block[0] if span_semantics and split > 0 else None
            if first in (ssep, pdep):
                segment = first
            # generated layout ids: real tokens here, hidden were they prompt
            real = tuple(k for k in range(split, hash_block_size) if block[k] in layout)
            real_tag = ((*REAL_LAYOUT_TAG, *real),) if real else ()
            if not span_semantics:
                pic = full
            elif segment == ssep and split < hash_block_size:
                # generated tokens after a prompt that ended inside a span: they attend to
                # every real key of the prompt, so the hash covers the whole prefix
                pic = kcu.hash_block_tokens(caching_hash_fn, prev_full, block,
                                            (*(extra or ()), (*DECODED_TAG, split)))
            elif first == ssep:
                salted = _with_salt(request, extra, start)
                pic = kcu.hash_block_tokens(
                    caching_hash_fn, None, block, (*(salted or ()), LAYOUT_TAG)
                )
            elif first == pdep:
                salted = _with_salt(request, extra, start)
                pic = kcu.hash_block_tokens(
                    caching_hash_fn, prev_full, block, (*(salted or ()), PDEP_TAG, *real_tag)
                )
            elif prev_pic == prev_full:  # no marker so far: the stock chain
                # a prompt without layout tokens is computed as a plain one, whatever the
                # model generates after it: the stock hash (shared with plain requests)
                pic = full if layout.isdisjoint(block[:split]) else kcu.hash_block_tokens(
                    caching_hash_fn, prev_full, block, (*(extra or ()), LAYOUT_TAG, *real_tag))
            else:
                pic = kcu.hash_block_tokens(caching_hash_fn, prev_pic, block,
                                            (*(extra or ()), *real_tag) if real_tag else extra)
            full_chain.append(full)
            new_hashes.append(pic)
            prev_full, prev_pic = full, pic
            start = end
        return new_hashes

    return request_block_hasher


def span_chained_blocks(request: Any, block_size: int, config: SpanConfig) -> list[bool]:
    """Per full block of ``request``: is it span-chained (its hash and KV cover only its span)?

    The blocks the hasher chains from an SSEP-led block, up to the next PDEP-led one: their
    hash restarts at the SSEP block (salt and LoRA keys included), and span isolation makes
    their KV depend on their span's tokens alone. Those are the blocks a span store may keep
    under their hash; any other block's KV depends on the whole prefix. Same rule as
    :func:`make_span_block_hasher`, derived from the prompt's tokens: a block whose first token
    was generated is no marker block, and a block holding generated tokens is never
    span-chained (they attend to the whole prompt; its hash covers it). False throughout for a
    request that did not opt in.
    """
    num_blocks = len(request.block_hashes)
    if not spans_opted_in(getattr(request, "sampling_params", None)):
        return [False] * num_blocks
    tokens = request.all_token_ids
    num_prompt = prompt_length(request)
    flags, in_span = [], False
    for index in range(num_blocks):
        start = index * block_size
        first = tokens[start] if start < num_prompt else None
        if first == config.ssep_id:
            in_span = True
        elif first == config.pdep_id:
            in_span = False
        flags.append(in_span and start + block_size <= num_prompt)
    return flags


# The EngineCore's config, recorded when it builds its scheduler (just before the hasher).
_ENGINE: dict[str, Any] = {"vllm_config": None}


def _wrap_scheduler_init(stock: Any) -> Any:
    """Record the engine's VllmConfig: the hasher factory gets only a block size and a hash
    function, but whether span hashing is safe depends on the model (hybrid or not), the block
    size and the config vLLM's compile cache keys on."""

    @functools.wraps(stock)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _ENGINE["vllm_config"] = kwargs.get("vllm_config", args[0] if args else None)
        stock(self, *args, **kwargs)

    return __init__


class HybridModelNotSupportedError(EngineIntegrationError):
    pass


def hasher_factory(config: SpanConfig) -> Callable[[Any], Any]:
    """The wrapper factory for vLLM's ``get_request_block_hasher`` (both names it is bound by):
    ``hasher_factory(config)(stock)`` takes vLLM's parameters, 0.32's two and 0.33's three."""

    def factory(stock: Any) -> Any:
        def get_request_block_hasher(hash_block_size: int,
                                     caching_hash_fn: Callable[[Any], bytes],
                                     num_hash_lookahead_tokens: int = 0):
            # vLLM 0.33: a drafter's lookahead makes each hash cover tokens *after* its block,
            # so an SSEP span's hash would name the tokens that follow the span wherever it
            # sits: span-local reuse is gone by construction. Refused, not approximated.
            if num_hash_lookahead_tokens:
                raise EngineIntegrationError(
                    f"minipic span hashing cannot run with num_hash_lookahead_tokens="
                    f"{num_hash_lookahead_tokens} (a speculative drafter whose KV depends on "
                    f"the tokens after each block): a span's hash would depend on what follows "
                    f"the span. Start vLLM with disable_lookahead_block_hashes=True, or without "
                    f"the drafter, or without the minipic plugin (MINIPIC_ENABLE=0)")
            vllm_config = _ENGINE["vllm_config"]
            if vllm_config is None:
                raise EngineIntegrationError(
                    "minipic span hashing: the engine built its block hasher before its "
                    "scheduler, so the hybrid-model and block-size checks cannot run (vLLM "
                    "changed EngineCore.__init__); refusing to start without them")
            check_supported(vllm_config, config)
            return make_span_block_hasher(hash_block_size, caching_hash_fn, config)

        get_request_block_hasher._minipic = True  # type: ignore[attr-defined]
        get_request_block_hasher._stock = stock  # type: ignore[attr-defined]
        return get_request_block_hasher

    return factory


def install(config: SpanConfig) -> None:
    """Replace vLLM's request block hasher everywhere it is bound by name (EngineCore process).

    ``vllm.v1.engine.core`` imported ``get_request_block_hasher`` by value, so patching only
    ``kv_cache_utils`` would silently do nothing for the engine.
    """
    from minipic.engine_ext.vllm_surface import patches

    factory = hasher_factory(config)
    hashers = [p.target for p in patches.points("hash") if p.target.endswith("block_hasher")]
    patches.apply("hash", {
        **{target: factory for target in hashers},
        "vllm.v1.core.sched.scheduler:Scheduler.__init__": _wrap_scheduler_init,
    })


def check_supported(vllm_config: Any, config: SpanConfig) -> None:
    """Refuse configurations where span hashes would produce false hits or never hit, or where
    vLLM's config (what its compile cache keys on) does not carry the span config we run."""
    minipic = (getattr(vllm_config, "additional_config", None) or {}).get("minipic")
    ours = config.model_dump(mode="json")  # as it reads after a trip through JSON (serve)
    if minipic is not None and minipic.get("span_config", ours) != ours:
        raise EngineIntegrationError(
            f"vLLM's additional_config says span_config={minipic.get('span_config')} but the "
            f"minipic plugin runs {ours}; start engines through minipic "
            f"(EngineSettings / minipic serve) so both come from one place")
    compiled = not getattr(vllm_config.model_config, "enforce_eager", True)
    if minipic is None and compiled:
        raise EngineIntegrationError(
            "minipic in compiled mode needs its settings in vLLM's additional_config (vLLM's "
            "compile cache keys on it, not on plugin code or environment); start the engine "
            "through minipic, or pass enforce_eager=True")
    model_config = vllm_config.model_config
    if getattr(model_config, "is_hybrid", False):
        raise HybridModelNotSupportedError(
            "minipic span hashing is refused for hybrid (attention + recurrent) models: a "
            "recurrent state depends on the whole prefix, so an SSEP chain reset would give "
            "false hits. Start the engine without the plugin (MINIPIC_ENABLE=0) or use the "
            "sparse recurrent checkpoints feature."
        )
    block_size = vllm_config.cache_config.block_size
    if block_size != config.block_size:
        raise ValueError(
            f"minipic span config says block_size={config.block_size} but the engine runs "
            f"block_size={block_size}; spans would not align to blocks"
        )
