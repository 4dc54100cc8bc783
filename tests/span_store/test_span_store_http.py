"""`minipic serve --span-store DIR` over HTTP: the store in the server's own process tree.

A real server (tiny random Llama), a plain httpx client with token-id prompts and the span
opt-in: spans prefilled, the server's prefix cache reset, and the final still reports its span
tokens cached (``usage.prompt_tokens_details.cached_tokens``), with the same greedy answer; the
store's per-tier counters are on ``GET /minipic/config`` and the cached tokens' split by source
(pool / store RAM / disk) on Prometheus ``/metrics``. Then the server is SIGKILLed and a new
one started on the same directory: its first final is warm from disk.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.pic_reference import build_pic_prompt, random_ordinary_ids
from support.servers import ServerProcess

from minipic.engine_ext.endpoints import CONFIG_PATH, RESET_PATH
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY, SpanConfig

pytestmark = pytest.mark.server


def _complete(base_url: str, ids: list[int], max_tokens: int = 4) -> dict:
    body = {"model": "minipic", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "vllm_xargs": {SPANS_OPT_IN_KEY: True}}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()


def _cached(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _store(base_url: str) -> dict:
    config = httpx.get(base_url + CONFIG_PATH, timeout=30).json()
    assert config.get("span_store"), "the server reports no span store"
    return config["span_store"]


def _cached_by_source(base_url: str) -> dict[str, float]:
    """``minipic:cached_prompt_tokens_total`` per source label, summed over engines."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    split: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "minipic:cached_prompt_tokens_total":
                source = sample.labels["source"]
                split[source] = split.get(source, 0.0) + sample.value
    return split


def _wait_split(base_url: str, ready: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The split once ``ready`` (the front-end records a step's stats as its outputs arrive,
    which may be just after the HTTP answer)."""
    deadline = time.monotonic() + 30
    split = _cached_by_source(base_url)
    while not ready(split) and time.monotonic() < deadline:
        time.sleep(0.2)
        split = _cached_by_source(base_url)
    return split


def _server(store_dir: str) -> ServerProcess:
    return ServerProcess("--model", "tiny-llama", "--max-model-len", "2048",
                         "--enable-cache-reset", "--span-store", store_dir).start()


def test_store_over_http_survives_reset_and_sigkill(tmp_path, seed) -> None:
    store_dir = str(tmp_path / "store")
    server = _server(store_dir)
    try:
        cfg = SpanConfig.model_validate(httpx.get(server.base_url + CONFIG_PATH,
                                                  timeout=30).json()["span_config"])
        rng = random.Random(seed)
        avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
        vocab = 1000  # the tiny model's ids below this are ordinary tokens
        prompt = build_pic_prompt(cfg, [random_ordinary_ids(rng, n, vocab, avoid)
                                        for n in (45, 60, 30)],
                                  random_ordinary_ids(rng, 9, vocab, avoid))
        for span in prompt.span_prefills:
            _complete(server.base_url, span, max_tokens=1)
        warm = _complete(server.base_url, prompt.token_ids)
        assert _cached(warm) == prompt.span_tokens, f"seed={seed}"
        blocks = prompt.span_tokens // cfg.block_size
        deadline = time.monotonic() + 60
        # saved (the worker's RAM tier), then written to disk off the engine's thread
        while _store(server.base_url)["counts"].get("saved_blocks", 0) < blocks or len(
                list((tmp_path / "store").rglob("*.kvb"))) < blocks:
            assert time.monotonic() < deadline, "the store did not save the spans"
            time.sleep(0.2)
        assert httpx.post(server.base_url + RESET_PATH, timeout=30).json()["success"]
        loaded = _complete(server.base_url, prompt.token_ids)
        assert _cached(loaded) == prompt.span_tokens, f"seed={seed}"
        assert loaded["choices"][0]["text"] == warm["choices"][0]["text"]
        counts = _store(server.base_url)["counts"]
        assert counts.get("tokens_ram", 0) + counts.get("tokens_disk", 0) == prompt.span_tokens
        # /metrics: the warm final's span tokens came from the pool, the loaded one's from the store
        split = _wait_split(server.base_url, lambda got: got.get("store_ram", 0) + got.get(
            "store_disk", 0) >= prompt.span_tokens)
        assert set(split) == {"pool", "store_ram", "store_disk", "store_shared"}, split
        assert split["store_ram"] + split["store_disk"] == prompt.span_tokens, split
        assert split["store_ram"] == counts.get("tokens_ram", 0), split
        assert split["pool"] >= prompt.span_tokens and split["store_shared"] == 0, split
        # the writes are on disk: kill the whole server, no shutdown
        assert server.proc is not None
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
    finally:
        server.stop()
    restarted = _server(store_dir)
    try:
        first = _complete(restarted.base_url, prompt.token_ids)
        assert _cached(first) == prompt.span_tokens, f"seed={seed}"
        assert first["choices"][0]["text"] == warm["choices"][0]["text"]
        assert _store(restarted.base_url)["counts"].get("tokens_disk", 0) == prompt.span_tokens
        split = _wait_split(restarted.base_url, lambda got: got.get("store_disk", 0) > 0)
        assert split["store_disk"] == prompt.span_tokens and split["store_ram"] == 0, split
    finally:
        restarted.stop()
