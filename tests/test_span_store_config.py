"""Span store settings: flags -> config -> what vLLM is started with (no engine needed).

``minipic serve --span-store DIR`` is the local disk tier; with ``--replicas N`` the same
directory becomes the tier every replica shares (one local directory per replica would leave
each replica warm only in its own spans). The weights digest in every key changes with the
weights, so a store never serves KV of other weights.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from span_contract.span_store_config import CONNECTOR_MODULE, SpanStoreConfig, weights_digest

pytestmark = pytest.mark.fast


def _serve_args(*argv: str) -> argparse.Namespace:
    from minipic.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags(tmp_path, monkeypatch) -> None:
    from minipic.serve import span_store_config
    from span_contract.span_store_config import DEFAULT_ENV

    # the default: on, next to the models (the test session sets the variable to "off" so that
    # the suite's servers keep their pools alone; a user's shell does not)
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    monkeypatch.setenv("MINIPIC_CACHE_DIR", str(tmp_path / "cache"))
    default = span_store_config(_serve_args())
    assert default is not None and default.dir == str(tmp_path / "cache" / "span-store")
    assert default.shared_dir is None and (default.disk_gib, default.ram_mib) == (8.0, 256)
    clustered = span_store_config(_serve_args("--replicas", "2"))  # one tier all replicas share
    assert clustered.dir is None and clustered.shared_dir == default.dir
    for off in (["--no-pic"], ["--features", "hash,rope"], ["--ckpt-budget", "4"]):
        assert span_store_config(_serve_args(*off)) is None, off
    assert span_store_config(_serve_args("--features", "hash,rope,holes")).dir == default.dir
    monkeypatch.setenv(DEFAULT_ENV, str(tmp_path / "elsewhere"))
    assert span_store_config(_serve_args()).dir == str(tmp_path / "elsewhere")
    monkeypatch.setenv(DEFAULT_ENV, "off")
    assert span_store_config(_serve_args()) is None
    monkeypatch.delenv(DEFAULT_ENV)
    assert span_store_config(_serve_args("--span-store", "off")) is None
    local = span_store_config(_serve_args("--span-store", str(tmp_path), "--span-store-gib", "2"))
    assert local.dir == str(tmp_path) and local.shared_dir is None and local.disk_gib == 2
    shared = span_store_config(_serve_args("--span-store", str(tmp_path), "--replicas", "2"))
    assert shared.dir is None and shared.shared_dir == str(tmp_path)
    both = span_store_config(_serve_args("--span-store", "a", "--span-store-shared", "b"))
    assert (both.dir, both.shared_dir) == ("a", "b")


def test_engine_gets_the_connector(tmp_path) -> None:
    from span_contract.engine_config import EngineSettings

    settings = EngineSettings(model="tiny-llama", span_store=str(tmp_path / "s")).resolved()
    store = settings.span_store
    assert store is not None and os.path.isabs(store.dir) and len(store.weights_digest) == 32
    config = settings.llm_kwargs()["kv_transfer_config"]
    assert config["kv_connector_module_path"] == CONNECTOR_MODULE
    assert config["kv_role"] == "kv_both"
    assert SpanStoreConfig.from_extra_config(config["kv_connector_extra_config"]) == store
    argv = settings.server_argv("127.0.0.1", 8000, "m")
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == config
    with pytest.raises(ValueError, match="plugin"):
        EngineSettings(model="tiny-llama", pic=False, span_store=str(tmp_path)).resolved()
    assert "kv_transfer_config" not in EngineSettings(model="tiny-llama").resolved().llm_kwargs()
    # vLLM reserves a core more for any KV connector; a store engine keeps stock's cores
    assert settings.plugin_env().get("VLLM_CPU_NUM_OF_RESERVED_CPU") == os.environ.get(
        "VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def test_weights_digest_follows_the_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINIPIC_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    first = weights_digest(str(model))
    assert weights_digest(str(model)) == first  # cached, same answer
    (model / "model.safetensors").write_bytes(os.urandom(4096))  # other weights, same size
    assert weights_digest(str(model)) != first
