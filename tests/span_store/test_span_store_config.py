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

from minipic.span_contract.env import CACHE_DIR_ENV
from minipic.span_contract.span_store_config import (
    CONNECTOR_MODULE,
    SpanStoreConfig,
    weights_digest,
)

pytestmark = pytest.mark.fast


def _serve_args(*argv: str) -> argparse.Namespace:
    from minipic.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags(tmp_path, monkeypatch) -> None:
    from minipic.serve import span_store_config
    from minipic.span_contract.span_store_config import DEFAULT_ENV

    # the default: on, next to the models (the test session sets the variable to "off" so that
    # the suite's servers keep their pools alone; a user's shell does not)
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
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
    from minipic.span_contract.engine_config import EngineSettings

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
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    first = weights_digest(str(model))
    assert weights_digest(str(model)) == first  # cached, same answer
    (model / "model.safetensors").write_bytes(os.urandom(4096))  # other weights, same size
    assert weights_digest(str(model)) != first


def test_weights_digest_covers_remote_code(tmp_path, monkeypatch) -> None:
    """A ``trust_remote_code`` model computes its KV with the ``.py`` files of its folder."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    (model / "modeling_x.py").write_text("SCALE = 1.0\n")
    first = weights_digest(str(model))
    (model / "modeling_x.py").write_text("SCALE = 2.0\n")
    assert weights_digest(str(model)) != first


def test_each_engine_checks_the_launchers_digest_against_its_own_files(tmp_path,
                                                                       monkeypatch) -> None:
    """The engine hashes the files it finds (cached), never trusting the launcher's digest: a
    folder replaced after the launcher hashed it turns the store off with a reason."""
    from types import SimpleNamespace

    from minipic.engine_ext.span_store.connector import engine_weights_digest

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    launched = SpanStoreConfig(dir=str(tmp_path / "s")).resolved(str(model))
    engine_model = SimpleNamespace(model=str(model), revision=None)
    assert engine_weights_digest(launched, engine_model) == (launched.weights_digest, None)
    (model / "model.safetensors").write_bytes(os.urandom(4096))  # replaced during start-up
    assert engine_weights_digest(launched, engine_model) == ("", "weights_mismatch")
    # a config launched for another model name: the engine's own digest stands
    other = launched.model_copy(update={"weights_of": "another@"})
    assert engine_weights_digest(other, engine_model) == (weights_digest(str(model)), None)
    gone = SimpleNamespace(model=str(tmp_path / "nowhere"), revision=None)
    assert engine_weights_digest(launched, gone) == ("", "weights_unknown")


def test_weights_digest_is_unknown_without_weights(tmp_path, monkeypatch) -> None:
    """A name is not a digest: a hub id with no local snapshot, or a folder with no weight
    files, gives "" (no store), never a hash of the name."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert weights_digest("some-org/not-downloaded-model") == ""
    configs_only = tmp_path / "configs"
    configs_only.mkdir()
    (configs_only / "config.json").write_text("{}")
    assert weights_digest(str(configs_only)) == ""


def _vllm_config(**overrides):
    """A real vLLM config for tiny-llama as minipic starts it (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    from minipic.span_contract.engine_config import EngineSettings

    settings = EngineSettings(model="tiny-llama").resolved()
    kwargs = {**settings.llm_kwargs(), **overrides}
    kwargs.pop("disable_log_stats", None)
    return EngineArgs(**kwargs).create_engine_config(), settings.span_config


def _with_model_fields(config, **fields):
    """A copy of ``config`` whose model config differs in ``fields`` only (set as attributes:
    vLLM would validate a revision against the hub, or fp8 against the CPU, on a fresh build)."""
    model = config.model_config.__class__.__new__(config.model_config.__class__)
    model.__dict__.update({**config.model_config.__dict__, **fields})
    copy = config.__class__(**{**config.__dict__})
    copy.model_config = model
    return copy


@pytest.fixture(scope="module")
def base_config():
    return _vllm_config()


@pytest.mark.parametrize("change", ["weights", "revision", "hf_overrides", "quantization",
                                    "dtype", "block_size", "engine_code", "span_config", "sink",
                                    "sink_gap", "load_format", "loader_extra", "vllm", "torch",
                                    "compilation", "model_impl"])
def test_every_input_of_the_kv_changes_the_fingerprint_and_the_keys(base_config, change,
                                                                    tmp_path, monkeypatch,
                                                                    seed) -> None:
    """Changed one at a time, each input gives another fingerprint: entries the first
    configuration stored are found by no key of the second, and read under the first's key they
    are foreign (a miss). Everything else is held equal."""
    import random

    from vllm.v1.core import kv_cache_utils

    import minipic.span_contract.engine_config as engine_config
    from minipic.engine_ext.span_store.keys import entry_key
    from minipic.engine_ext.span_store.tiers import DirTier, Entry
    from minipic.span_contract.span_config import SpanConfig
    from minipic.span_contract.span_store_config import config_fingerprint, fingerprint_facts

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:  # set at engine start otherwise
        from vllm.utils.hashing import sha256_cbor

        kv_cache_utils.init_none_hash(sha256_cbor)
    config, span = base_config
    digest = "a" * 32
    first = config_fingerprint(config, digest, span)
    facts = fingerprint_facts(config, digest, span)
    other_config, other_digest, other_span = config, digest, span
    if change == "weights":
        other_digest = "b" * 32
    elif change == "revision":
        other_config = _with_model_fields(config, revision="v2")
    elif change == "hf_overrides":
        other_config, _ = _vllm_config(hf_overrides={"rope_theta": 20000.0})
    elif change == "quantization":
        other_config = _with_model_fields(config, quantization="fp8")
    elif change == "dtype":
        other_config, _ = _vllm_config(dtype="bfloat16")
    elif change == "block_size":
        other_config, _ = _vllm_config(block_size=64)
        other_span = SpanConfig(**{**span.model_dump(), "block_size": 64})
    elif change == "engine_code":
        monkeypatch.setattr(engine_config, "plugin_code_hash", lambda: "0" * 16)
    elif change == "span_config":
        other_span = SpanConfig(**{**span.model_dump(), "pad_id": span.pad_id + 1})
    elif change == "sink":  # spans that sink into another opening compute other KV
        other_span = SpanConfig(**{**span.model_dump(), "sink_ids": (1, 2, 3)})
    elif change == "sink_gap":  # the same opening further from the text: other positions
        other_span = SpanConfig(**{**span.model_dump(), "sink_gap": span.sink_gap + 64})
    elif change == "load_format":  # random weights from the same folder
        other_config, _ = _vllm_config(load_format="dummy")
    elif change == "loader_extra":
        other_config, _ = _vllm_config(model_loader_extra_config={"enable_multithread_load": True})
    elif change in ("vllm", "torch"):
        import torch
        import vllm

        module = vllm if change == "vllm" else torch
        monkeypatch.setattr(module, "__version__", module.__version__ + ".post1")
    elif change == "compilation":
        other_config, _ = _vllm_config(enforce_eager=not config.model_config.enforce_eager)
    elif change == "model_impl":
        other_config = _with_model_fields(config, model_impl="transformers")
    other_facts = fingerprint_facts(other_config, other_digest, other_span)
    changed = {k for k in facts if facts[k] != other_facts[k]}
    assert changed, f"{change} is not among the fingerprint's inputs"
    second = config_fingerprint(other_config, other_digest, other_span)
    assert second != first
    # the store: what the first stored, the second never finds, by key or by name
    rng = random.Random(seed)
    hashes = [rng.randbytes(32) for _ in range(6)]
    writer = DirTier(tmp_path, 1 << 24, first)
    for h in hashes:
        assert writer.put(entry_key(first, h), Entry(rng.randbytes(64), {"home": 0}))
    reader = DirTier(tmp_path, 1 << 24, second)
    assert sum(reader.has(entry_key(second, h)) for h in hashes) == 0
    assert all(reader.get(entry_key(first, h)) is None for h in hashes)
    assert reader.stats()["foreign_skipped"] == len(hashes)


def test_engine_code_hash_follows_the_code(tmp_path) -> None:
    import shutil
    from pathlib import Path

    from minipic.span_contract.engine_config import code_hash

    repo = Path(__file__).resolve().parents[2]
    for package in ("engine_ext", "kernels"):
        shutil.copytree(repo / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    seen = {code_hash(tmp_path)}
    # any engine file, and every file that decides what attention computes (rule 1 among it:
    # entries written under the old layout rule must never load under the new one)
    for name in ("engine_ext/span_store/worker_side.py", "engine_ext/attention/span_isolation.py",
                 "engine_ext/attention/step_plan.py", "engine_ext/attention/cpu_backend.py",
                 "engine_ext/attention/cuda_backend.py", "engine_ext/hashing/span_hashing.py",
                 "kernels/paged_attention_ref.py", "kernels/triton_paged_attention.py"):
        target = tmp_path / name
        target.write_text(target.read_text() + "\n# an edit\n")
        seen.add(code_hash(tmp_path))
    assert len(seen) == 9


def test_tensor_parallel_gets_a_core_group_per_rank(tmp_path, monkeypatch) -> None:
    """The store runs with tensor parallelism (tests/span_store/test_span_store.py); on CPU each
    rank needs its own cores, which minipic sets where the user has not."""
    from minipic.serve import _tensor_parallel, _tp_thread_binding
    from minipic.span_contract.cpu_runtime import THREADS_BIND_ENV, thread_binding
    from minipic.span_contract.engine_config import EngineSettings

    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert thread_binding(4, [0, 1]) is None and thread_binding(1, [0, 1]) is None
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    settings = EngineSettings(model="tiny-llama", span_store=str(tmp_path),
                              extra={"tensor_parallel_size": 2}).resolved()
    expected = thread_binding(2)
    assert settings.plugin_env().get(THREADS_BIND_ENV) == expected
    assert _tp_thread_binding(2) == expected and _tp_thread_binding(1) is None
    monkeypatch.setenv(THREADS_BIND_ENV, "0-1|2-3")  # the user's own: kept
    assert THREADS_BIND_ENV not in settings.plugin_env() and _tp_thread_binding(2) is None
    assert _tensor_parallel(["--tensor-parallel-size", "2"]) == 2
    assert _tensor_parallel(["-tp=4", "--dtype", "float32"]) == 4
    assert _tensor_parallel(["--dtype", "float32"]) == 1
