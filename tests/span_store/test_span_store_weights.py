"""What names the weights and the other inputs of a span store entry's KV (issue 54, items 1-2).

* The weights digest is cached under a stamp a replacement cannot keep (size, mtime, ctime,
  inode, device): new weights with the sizes and mtimes of the old ones -- fine-tunes of one
  architecture, builds that normalise timestamps -- get a new digest. The engine's check keeps
  its own cache: a stale or written-over launcher cache entry cannot make it agree.
* Every input the fingerprint did not name is now named (``--hf-config-path``,
  ``--config-format``, the speculative drafter) or turns the store off with the reason
  (weights loaded from a URI or by tensorizer, a callable ``hf_overrides``).

Real files, real folders, a real vLLM config of the test model (no engine is started).
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_span_store_config import _vllm_config

from minipic.span_contract.env import CACHE_DIR_ENV
from minipic.span_contract.span_store_config import (
    SpanStoreConfig,
    config_fingerprint,
    fingerprint_facts,
    weights_digest,
)

pytestmark = pytest.mark.fast

TENSOR_BYTES = 3 << 20  # above the size whose bytes are hashed at every look


def _safetensors(rng: random.Random) -> bytes:
    """A real safetensors file: one float32 tensor, the same header for every draw (a
    fine-tune of one architecture), fresh tensor bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [TENSOR_BYTES // 4],
                               "data_offsets": [0, TENSOR_BYTES]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + rng.randbytes(TENSOR_BYTES)


def _model(tmp_path: Path, rng: random.Random) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["X"]}')
    (model / "model.safetensors").write_bytes(_safetensors(rng))
    return model


def _settled_clock(monkeypatch) -> None:
    """The files a test writes are seconds old, not milliseconds: digests are cached (a file
    changed within the kernel clock's tick of a stamp is "racy" and never cached)."""
    try:
        from minipic.span_contract import weights_digest as module
    except ImportError:  # the code before issue 54 had no such rule: it always caches
        return
    import time

    monkeypatch.setattr(module, "_now_ns", lambda: time.time_ns() + 60 * 10**9)


def _replace_same_stamp(path: Path, data: bytes, how: str) -> None:
    """Other bytes of the same size, the old mtime restored: what a fine-tune unpacked by a
    build with normalised timestamps looks like."""
    before = path.stat()
    if how == "in_place":
        # a kernel without fine-grained ctimes (before 6.13) may give a write in the tick of
        # the stamp the same ctime: that window is the "racy" rule's, which this test's settled
        # clock turns off, so the write is repeated until the kernel's clock has moved on
        while path.stat().st_ctime_ns == before.st_ctime_ns:
            with path.open("r+b") as handle:
                handle.write(data)
    else:  # renamed over the old file, as an image layer or a sync tool does
        fresh = path.with_name(path.name + ".new")
        fresh.write_bytes(data)
        os.replace(fresh, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("how", ["in_place", "renamed"])
def test_new_weights_with_the_old_sizes_and_mtimes_get_a_new_digest(tmp_path, monkeypatch,
                                                                    seed, how) -> None:
    from minipic.engine_ext.span_store.connector import engine_weights_digest

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    _settled_clock(monkeypatch)
    rng = random.Random(seed)
    model = _model(tmp_path, rng)
    engine_model = SimpleNamespace(model=str(model), revision=None)
    launched = SpanStoreConfig().resolved(str(model))
    first = launched.weights_digest
    assert len(first) == 32 and weights_digest(str(model)) == first  # cached, same answer
    assert engine_weights_digest(launched, engine_model) == (first, None)
    _replace_same_stamp(model / "model.safetensors", _safetensors(rng), how)
    second = weights_digest(str(model))
    assert second != first
    # the engine finds the new weights too; launched with the old digest, it turns the store off
    assert engine_weights_digest(launched, engine_model) == ("", "weights_mismatch")
    relaunched = SpanStoreConfig().resolved(str(model))
    assert engine_weights_digest(relaunched, engine_model) == (second, None)


def test_the_engine_does_not_trust_the_launchers_cache(tmp_path, monkeypatch, seed) -> None:
    """A launcher cache entry with the current stamp and a wrong digest (left by a bug, or
    written by someone) fools the launcher; the engine's check hashes on its own and turns the
    store off instead of writing this engine's KV under the other weights' name."""
    from minipic.engine_ext.span_store.connector import engine_weights_digest

    rng = random.Random(seed)
    model = _model(tmp_path, rng)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "truth"))
    _settled_clock(monkeypatch)
    old = weights_digest(str(model))
    _replace_same_stamp(model / "model.safetensors", _safetensors(rng), "renamed")
    true = weights_digest(str(model))  # a cache that never saw the old weights
    assert true != old
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert weights_digest(str(model)) == true  # the launcher's cache records the new stamp ...
    cache = tmp_path / "cache" / "weights-digests.json"
    known = json.loads(cache.read_text())
    (entry,) = known.values()
    entry["digest"] = old  # ... and someone puts the old weights' digest under it
    cache.write_text(json.dumps(known))
    launched = SpanStoreConfig().resolved(str(model))
    assert launched.weights_digest == old  # the launcher is fooled
    engine_model = SimpleNamespace(model=str(model), revision=None)
    assert engine_weights_digest(launched, engine_model) == ("", "weights_mismatch")
    elsewhere = launched.model_copy(update={"weights_of": "another@"})
    assert engine_weights_digest(elsewhere, engine_model) == (true, None)


def test_a_restart_rehashes_nothing_and_a_racy_digest_is_not_kept(tmp_path, monkeypatch,
                                                                   seed) -> None:
    """Unchanged files are hashed in full once per side (launcher, engine), never at a restart;
    a digest taken within the clock's tick of a file's change is not cached (a rewrite in place
    in that tick could keep the whole stamp)."""
    from minipic.span_contract import weights_digest as module

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    model = _model(tmp_path, random.Random(seed))
    full = []
    real = module._full_digest
    monkeypatch.setattr(module, "_full_digest", lambda files: full.append(1) or real(files))
    ctime = (model / "model.safetensors").stat().st_ctime_ns
    monkeypatch.setattr(module, "_now_ns", lambda: ctime)  # hashed in the tick of the change
    first = module.weights_digest(str(model))
    assert module.weights_digest(str(model)) == first and len(full) == 2  # not kept
    monkeypatch.setattr(module, "_now_ns", lambda: ctime + 60 * 10**9)
    for _ in range(3):
        assert module.weights_digest(str(model)) == first
        assert module.engine_digest(str(model)) == first
    assert len(full) == 4  # once more per side, then the caches answer


# -- the inputs the fingerprint did not name --------------------------------------------------


@pytest.fixture(scope="module")
def base():
    return _vllm_config()


def _variant(config, *, model=None, load=None, **parts):
    """A duck-typed copy of the real ``VllmConfig`` with some attributes changed
    (``fingerprint_facts`` and ``unnamed_kv_inputs`` only read attributes)."""
    out = dict(vars(config))
    if model:
        cls = config.model_config.__class__
        out["model_config"] = cls.__new__(cls)
        out["model_config"].__dict__.update({**config.model_config.__dict__, **model})
    if load:
        out["load_config"] = copy.copy(config.load_config)
        out["load_config"].__dict__.update(load)
    out.update(parts)
    return SimpleNamespace(**out)


def _refusal(vllm_config) -> str | None:
    from minipic.engine_ext.span_store.connector import engine_store_check

    digest, reason, detail = engine_store_check(SpanStoreConfig(), vllm_config)
    if reason is None:
        return None
    assert reason == "kv_inputs_unnamed" and digest == "" and detail
    return detail


def test_an_external_config_is_named_by_path_format_and_bytes(base, tmp_path) -> None:
    config, span = base
    digest = "a" * 32
    first = config_fingerprint(config, digest, span)
    folder = tmp_path / "other-config"
    folder.mkdir()
    (folder / "config.json").write_text('{"rope_theta": 10000.0}')
    external = _variant(config, model={"hf_config_path": str(folder)})
    second = config_fingerprint(external, digest, span)
    assert second != first
    (folder / "config.json").write_text('{"rope_theta": 20000.0}')  # same path, other config
    third = config_fingerprint(external, digest, span)
    assert third not in (first, second)
    file = tmp_path / "config.json"  # a config file rather than a folder
    file.write_text('{"rope_theta": 10000.0}')
    assert config_fingerprint(_variant(config, model={"hf_config_path": str(file)}), digest,
                              span) not in (first, second, third)
    mistral = _variant(config, model={"config_format": "mistral"})
    assert config_fingerprint(mistral, digest, span) != first
    nowhere = _variant(config, model={"hf_config_path": str(tmp_path / "nowhere")})
    assert "hf-config-path" in _refusal(nowhere)


def test_a_drafter_is_named_by_method_model_weights_and_tokens(base, tmp_path, monkeypatch,
                                                               seed) -> None:
    """A drafter's attention layers keep KV of their own, saved with a block's pages."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    _settled_clock(monkeypatch)
    config, span = base
    digest = "a" * 32
    rng = random.Random(seed)
    draft = _model(tmp_path, rng)

    def drafter(method="eagle", model=str(draft), tokens=3):
        spec = SimpleNamespace(method=method, model=model, num_speculative_tokens=tokens,
                               draft_model_config=SimpleNamespace(model=model, revision=None,
                                                                  quantization=None))
        return _variant(config, speculative_config=spec)

    plain = config_fingerprint(config, digest, span)
    eagle = config_fingerprint(drafter(), digest, span)
    seen = {plain, eagle}
    for other in (drafter(tokens=4), drafter(method="ngram", model="ngram"),
                  drafter(method="mtp", model=str(config.model_config.model))):
        seen.add(config_fingerprint(other, digest, span))
    assert len(seen) == 5
    _replace_same_stamp(draft / "model.safetensors", _safetensors(rng), "renamed")
    assert config_fingerprint(drafter(), digest, span) not in seen  # other drafter weights
    assert _refusal(drafter()) is None
    assert "drafter" in _refusal(drafter(model=str(tmp_path / "nowhere")))
    assert "drafter" in _refusal(drafter(model="s3://bucket/drafter"))
    assert "proposer" in _refusal(drafter(method="custom_class"))


def test_weights_loaded_from_elsewhere_turn_the_store_off(base, tmp_path, monkeypatch) -> None:
    """The digest names the model folder's files; a load that reads something else would be
    named by files it never read."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    config, _ = base
    assert _refusal(config) is None  # the test model, as minipic starts it
    for load in ({"load_format": "tensorizer"}, {"load_format": "ipc_cache"},
                 {"load_format": "modelexpress"}, {"load_format": "a-plugins-format"}):
        assert "cannot name" in _refusal(_variant(config, load=load)), load
    streamed = _variant(config, model={"model_weights": "s3://bucket/model"},
                        load={"load_format": "runai_streamer"})
    assert "s3://bucket/model" in _refusal(streamed)
    assert "gs://bucket/model" in _refusal(_variant(config, model={"model": "gs://bucket/model"}))
    hub = _variant(config, model={"model": "some-org/some-model"},
                   load={"download_dir": str(tmp_path / "dl")})
    assert "download-dir" in _refusal(hub)


def test_a_callable_hf_overrides_turns_the_store_off_and_names_no_address(base) -> None:
    """``repr`` of a function holds its address: every process had another fingerprint, so
    the store wrote and never hit. Its effect cannot be named: the store is off for it."""
    config, span = base

    def shrink(hf_config):
        return hf_config

    twin = types.FunctionType(shrink.__code__, shrink.__globals__, "shrink")
    twin.__qualname__ = shrink.__qualname__  # the same function at another address
    one = _variant(config, model={"hf_overrides": shrink})
    other = _variant(config, model={"hf_overrides": twin})
    facts = fingerprint_facts(one, "a" * 32, span)
    assert " at 0x" not in json.dumps(facts, default=repr)
    assert config_fingerprint(one, "a" * 32, span) == config_fingerprint(other, "a" * 32, span)
    assert "hf_overrides" in _refusal(one)
