"""``HttpBackend``: ``minipic serve`` (vLLM's OpenAI server) over httpx.

Requests are ``POST /v1/completions`` with a token-id list as ``prompt`` (the prompt builder
already placed SSEP / PDEP / PAD; the server must not re-tokenize), ``cache_salt`` when the caller
scopes the cache, ``stream: true`` and ``stream_options.include_usage``. Why streaming: the first
SSE chunk carrying text is the first token, so TTFT is measured as a client sees it; vLLM 0.32
puts ``usage.prompt_tokens_details.cached_tokens`` in the final usage chunk of a stream
(``completion/serving.py``, when the server runs with ``--enable-prompt-tokens-details``, as
``minipic serve`` does), so no second, non-streamed request is needed for the cache count.

On connect the backend reads ``GET /v1/models`` (served name, context length, model folder) and
``GET /minipic/config`` (block size and marker ids); the orchestrator compares the latter with
its prompt builder's ``SpanConfig``.

Errors: connection refused / reset / dropped mid-stream -> ``EngineUnreachableError``
(retryable); 5xx -> ``EngineError(retryable=True)``; 4xx -> ``BadInputError`` with the server's
message. Retrying is the scheduler's job, not this module's: a retry after a restart must re-warm
spans first, which only the scheduler knows how to do.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx

from minipic.orchestrator.backends import BackendInfo, Delta, Sampling, TransportBackend, Usage
from minipic.orchestrator.errors import (
    BadInputError,
    ConfigMismatchError,
    EngineError,
    EngineUnreachableError,
    RequestTimeoutError,
)
from minipic.span_contract.model_support import ModelSupport
from minipic.span_contract.span_config import ROUTE_AS_KEY, SPANS_OPT_IN_KEY, SpanConfig

CONFIG_PATH = "/minipic/config"
RESET_PATH = "/reset_prefix_cache"  # vLLM's, development mode only
MINIPIC_RESET_PATH = "/minipic/reset_prefix_cache"  # `minipic serve --enable-cache-reset`
# connect quickly or call the server unreachable; reads are bounded by the scheduler's timeout
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)


def _transport_error(exc: httpx.HTTPError, base_url: str) -> EngineError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return RequestTimeoutError(f"{base_url}: {type(exc).__name__}: {exc}")
    return EngineUnreachableError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}")


def _error_message(body: bytes | str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return str(body)[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)
    return str(err)


def _status_error(status: int, body: bytes | str, url: str) -> Exception:
    message = f"{url} answered {status}: {_error_message(body)}"
    if status >= 500:
        return EngineError(message, retryable=True, status_code=status)
    return BadInputError(message)


def fetch_server_info(
    base_url: str, model: str | None = None, tokenizer: str | None = None,
    *, timeout: float = 10.0, headers: Mapping[str, str] | None = None,
) -> tuple[BackendInfo, dict[str, Any]]:
    """Read what the orchestrator must know from a running server (blocking, two GETs).

    ``model``: the served model name (None: the only one served). ``tokenizer``: local folder for
    the prompt builder (None: the server's model folder when it exists here, else minipic's
    default model). Returns the info and the raw ``/minipic/config`` answer.
    """
    base_url = base_url.rstrip("/")
    try:
        with httpx.Client(base_url=base_url, timeout=timeout, headers=dict(headers or {})) as c:
            models = c.get("/v1/models")
            config = c.get(CONFIG_PATH)
    except httpx.HTTPError as exc:
        raise _transport_error(exc, base_url) from exc
    if models.status_code != 200:
        raise _status_error(models.status_code, models.content, base_url + "/v1/models")
    cards = models.json().get("data", [])
    names = [card["id"] for card in cards]
    if model is None:
        if len(cards) != 1:
            raise BadInputError(f"{base_url} serves {names}; pass model= to pick one")
        card = cards[0]
    else:
        matches = [card for card in cards if card["id"] == model]
        if not matches:
            raise BadInputError(f"{base_url} does not serve model {model!r}; it serves {names}")
        card = matches[0]
    if config.status_code == 404:
        raw: dict[str, Any] = {"enabled": False, "span_config": None, "missing": True}
    elif config.status_code != 200:
        raise _status_error(config.status_code, config.content, base_url + CONFIG_PATH)
    else:
        raw = config.json()
    span = raw.get("span_config")
    root = card.get("root")
    if tokenizer is None:
        tokenizer = root if root and os.path.isdir(root) else None
    from minipic.span_contract.models import resolve_model

    info = BackendInfo(
        kind="http", model=card["id"], tokenizer=resolve_model(tokenizer),
        max_model_len=int(card.get("max_model_len") or 2048),
        span_config=SpanConfig.model_validate(span) if raw.get("enabled") and span else None,
        model_support=ModelSupport.from_dict(raw.get("model_support")),
    )
    return info, raw


class HttpBackend(TransportBackend):
    """One OpenAI-compatible server. An ``httpx.AsyncClient`` is made per event loop (a client's
    connection pool belongs to the loop that opened it)."""

    def __init__(
        self, base_url: str, info: BackendInfo, *, headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.info = info
        self._headers = dict(headers or {})
        self._timeout = timeout
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.instance: str | None = None  # the server process id from /minipic/config
        # a cluster (`minipic serve --replicas`) routes a span prefill by the final it serves
        self.route_hints = False
        self._restarted = False
        # the server's span store (``minipic serve --span-store``), for learn_stored_spans
        self.span_store_fingerprint: str | None = None
        self.span_store_dirs: tuple[str, ...] = ()

    @classmethod
    def connect(
        cls, base_url: str, model: str | None = None, tokenizer: str | None = None,
        *, headers: Mapping[str, str] | None = None, allow_plugin_off: bool = False,
    ) -> HttpBackend:
        info, raw = fetch_server_info(base_url, model, tokenizer, headers=headers)
        if info.span_config is None and not allow_plugin_off:
            why = ("it has no GET /minipic/config (not `minipic serve`?)" if raw.get("missing")
                   else "its minipic plugin is off (`minipic serve --no-pic`)")
            raise ConfigMismatchError(
                f"{base_url} does not run span-aware caching: {why}. Pass allow_plugin_off=True "
                "to use it with mode='prefix' only"
            )
        backend = cls(base_url, info, headers=headers)
        backend.instance = raw.get("instance")
        cluster = raw.get("cluster")
        backend.route_hints = isinstance(cluster, dict) and cluster.get("route_hints") is True
        store = raw.get("span_store")
        if isinstance(store, dict):
            backend.span_store_fingerprint = store.get("fingerprint")
            config = store.get("config") or {}
            backend.span_store_dirs = tuple(
                str(d) for d in (config.get("dir"), config.get("shared_dir")) if d)
        return backend

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]  # clients of finished loops: their sockets died with them
            client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self._timeout, headers=self._headers,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            )
            self._clients[loop] = client
        return client

    def _request(self, token_ids: Sequence[int], sampling: Sampling, cache_salt: str | None,
                 request_id: str | None, route_as: Sequence[int] | None) -> dict[str, Any]:
        """The JSON body of ``POST /v1/completions`` (streamed, with the usage chunk)."""
        body: dict[str, Any] = {
            "model": self.info.model,
            "prompt": list(token_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            # Span semantics are opt-in per request (span_contract.span_config.SPANS_OPT_IN_KEY).
            "vllm_xargs": {SPANS_OPT_IN_KEY: True} if self.info.spans_served else {},
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if request_id is not None:
            body["request_id"] = request_id
        if route_as is not None and self.route_hints:
            body[ROUTE_AS_KEY] = list(route_as)
        return body

    async def _send(self, request: dict[str, Any], token_ids: Sequence[int]
                    ) -> AsyncIterator[Delta | Usage]:
        """One ``Delta`` per choice of each SSE chunk as the server sends them, then the final
        chunk's usage. Closed early, it closes the connection, which makes vLLM abort the
        request."""
        url = self.base_url + "/v1/completions"
        usage: dict[str, Any] | None = None
        try:
            async with self._client().stream("POST", "/v1/completions", json=request) as resp:
                if resp.status_code != 200:
                    raise _status_error(resp.status_code, await resp.aread(), url)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        code = int(err.get("code") or 500) if isinstance(err, dict) else 500
                        raise _status_error(code, data, url)
                    for choice in chunk.get("choices") or []:
                        yield Delta(choice.get("text") or "", choice.get("token_ids") or [],
                                    choice.get("finish_reason"))
                    usage = chunk.get("usage") or usage
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url) from exc
        if usage is None:
            raise EngineUnreachableError(f"{url}: stream ended without its usage chunk")
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" not in details:
            raise ConfigMismatchError(
                f"{self.base_url} does not report cached prompt tokens; start vLLM with "
                "--enable-prompt-tokens-details (`minipic serve` does)"
            )
        yield Usage(prompt_tokens=int(usage.get("prompt_tokens", len(token_ids))),
                    cached_tokens=int(details["cached_tokens"] or 0))

    async def prompt_logprobs(self, token_ids: Sequence[int], k: int, *,
                              spans: bool = True) -> list[dict[int, float] | None]:
        """``EmbeddedBackend.prompt_logprobs`` over HTTP (vLLM's ``prompt_logprobs`` field of
        ``/v1/completions``)."""
        url = self.base_url + "/v1/completions"
        body: dict[str, Any] = {"model": self.info.model, "prompt": list(token_ids),
                                "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}
        if spans:
            body["vllm_xargs"] = {SPANS_OPT_IN_KEY: True}
        try:
            resp = await self._client().post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url) from exc
        if resp.status_code != 200:
            raise _status_error(resp.status_code, resp.content, url)
        positions = resp.json()["choices"][0].get("prompt_logprobs")
        if not isinstance(positions, list):
            raise ConfigMismatchError(f"{url} returned no prompt_logprobs")
        return [None if pos is None else {int(t): float(v["logprob"]) for t, v in pos.items()}
                for pos in positions]

    async def reset_cache(self) -> None:
        """Empty the server's prefix cache: ``POST /minipic/reset_prefix_cache``, which
        ``minipic serve`` answers only when started with ``--enable-cache-reset`` (403 else).
        A server without that route (404: not minipic's) is asked at vLLM's development-mode
        ``/reset_prefix_cache`` instead."""
        resp = await self._post_reset(MINIPIC_RESET_PATH)
        if resp.status_code == 404:
            resp = await self._post_reset(RESET_PATH)
            if resp.status_code in (404, 405):
                raise EngineError(
                    f"{self.base_url} has no prefix-cache reset route: start it with `minipic "
                    "serve --enable-cache-reset` (vLLM's own /reset_prefix_cache needs "
                    "VLLM_SERVER_DEV_MODE=1 in the server's environment)"
                )
        if resp.status_code == 403:
            raise EngineError(f"{self.base_url} refused to reset its prefix cache: "
                              f"{_error_message(resp.content)}", status_code=403)
        if resp.status_code == 409:
            raise EngineError(f"{self.base_url}: {_error_message(resp.content)}",
                              retryable=True, status_code=409)
        if resp.status_code != 200:
            raise _status_error(resp.status_code, resp.content, str(resp.request.url))
        if resp.content and resp.json().get("success") is False:  # vLLM's route says so
            raise EngineError(f"{self.base_url} refused to reset its prefix cache (requests "
                              "running?)", retryable=True)

    async def _post_reset(self, path: str) -> httpx.Response:
        try:
            return await self._client().post(path)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url) from exc

    async def health(self) -> bool:
        try:
            return (await self._client().get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _note_instance(self, instance: object) -> None:
        if isinstance(instance, str) and instance != self.instance:
            self._restarted = self.instance is not None
            self.instance = instance

    def take_restart(self) -> bool:
        """Whether the last config read found another server process than before (once)."""
        restarted, self._restarted = self._restarted, False
        return restarted

    async def check_config(self) -> None:
        """Read ``GET /minipic/config`` again; ``ConfigMismatchError`` when the server now runs
        another span configuration than the one this backend connected to.

        Why again: a server restarted on the same port with another ``--block-size`` (or
        ``--no-pic``) answers every request, but prompts laid out for the old blocks never hit
        its cache — silently. The scheduler calls this after every lost connection (before it
        sends again) and when a final prompt finds spans cold.
        """
        try:
            resp = await self._client().get(CONFIG_PATH, timeout=10.0)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url) from exc
        if resp.status_code not in (200, 404):
            raise _status_error(resp.status_code, resp.content, self.base_url + CONFIG_PATH)
        try:
            raw = resp.json() if resp.status_code == 200 else {}
            raw = raw if isinstance(raw, dict) else {}
            self._note_instance(raw.get("instance"))
            span = raw.get("span_config")
            now = SpanConfig.model_validate(span) if raw.get("enabled") and span else None
        except ValueError as exc:  # not JSON, or not a SpanConfig (pydantic's is a ValueError)
            raise ConfigMismatchError(
                f"{self.base_url}{CONFIG_PATH} no longer answers a span configuration: {exc}"
            ) from None
        ours = self.info.span_config
        if now == ours:
            return
        if now is None or ours is None:
            diff = f"span-aware caching {'off' if now is None else 'on'} (was " \
                   f"{'off' if ours is None else 'on'})"
        else:
            diff = "; ".join(f"{name} {getattr(ours, name)} -> {getattr(now, name)}"
                             for name in SpanConfig.model_fields
                             if getattr(ours, name) != getattr(now, name))
        raise ConfigMismatchError(
            f"{self.base_url} now runs another span configuration than at connect: {diff}. "
            "Prompts laid out for the old one would never hit its cache; connect a new "
            "orchestrator (or restart the server with the old configuration)"
        )

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        if client is not None:
            await client.aclose()
        self._clients = {lp: c for lp, c in self._clients.items() if not lp.is_closed()}
