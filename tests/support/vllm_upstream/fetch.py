"""Fetch vLLM 0.32.0's own core tests from its PyPI sdist (pinned by sha256), once per cache.

Why from the sdist and not vendored: the tests stay exactly vLLM's (Apache-2.0, vLLM project,
https://github.com/vllm-project/vllm, release v0.32.0), nothing of them is committed here, and a
version bump only changes the pin below. The download is 44 MB from PyPI's file host, the
registry the rest of the set-up installs from; it is cached under the minipic cache.

Two additions make the tests runnable on a machine that reaches no model hub, for stock and
patched vLLM alike (so they cannot favour either):

* ``hf/``: a Hugging Face hub cache holding only ``config.json`` of ``facebook/opt-125m`` (the
  model vLLM's scheduler tests build their ``ModelConfig`` from; they never load weights or a
  tokenizer). Its values are the public OPT-125m configuration.
* ``tests/v1/conftest.py``: overrides vLLM's ``should_do_global_cleanup_after_test`` fixture to
  ``False`` (vLLM's documented switch for "non-GPU unit tests since they don't need to
  initialize torch"): the global clean-up costs 0.35 s per test, 3/4 of the run here.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

from minipic.span_contract.models import download, exclusive, sha256_of

VLLM_VERSION = "0.32.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"

# The list: prefix caching, KV-cache utils, scheduler, async scheduler, streaming
# input, single-type manager.
TEST_FILES = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/streaming_input/test_scheduler_streaming.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
)

OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0,
    "activation_function": "relu", "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
    "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02,
    "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
}

CONFTEST_OVERLAY = '''\
"""Added by minipic's harness (tests/support/vllm_upstream/fetch.py), not part of vLLM."""
import pytest


@pytest.fixture()
def should_do_global_cleanup_after_test() -> bool:
    return False
'''

PYTEST_INI = "[pytest]\nfilterwarnings = ignore::DeprecationWarning\n"


# The next vLLM, read (never installed) by tests/engine/test_vllm_next.py: its Python sources
# against the patch table (engine_ext/vllm_surface/patch_sources.py). 47 MB, the same host as above.
NEXT_VERSION = "0.33.0"
NEXT_SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/"
    "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
)
NEXT_SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"


def _download(dest: Path, url: str = SDIST_URL, sha256: str = SDIST_SHA256,
              version: str = VLLM_VERSION) -> None:
    try:
        download(url, dest, sha256, timeout=120)
    except OSError as exc:
        raise RuntimeError(
            f"could not download vLLM {version}'s sdist from PyPI ({exc}); without a "
            f"network, put vllm-{version}.tar.gz (sha256 {sha256}) at {dest}"
        ) from exc
    except ValueError as exc:
        raise RuntimeError(f"vllm-{version}.tar.gz: {exc}") from exc


def next_sources(cache: Path) -> Path:
    """A folder holding the next vLLM's ``vllm/`` Python package sources (not importable as
    installed: no compiled parts; read with
    ``engine_ext.vllm_surface.patch_sources.VllmSources``)."""
    root = cache / "vllm-sources" / NEXT_VERSION
    done = root / ".complete"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root.parent / f".{NEXT_VERSION}.lock"):
        if not done.exists():
            sdist = root.parent / f"vllm-{NEXT_VERSION}.tar.gz"
            if not sdist.exists() or sha256_of(sdist) != NEXT_SDIST_SHA256:
                _download(sdist, NEXT_SDIST_URL, NEXT_SDIST_SHA256, NEXT_VERSION)
            prefix = f"vllm-{NEXT_VERSION}/"
            with tarfile.open(sdist) as tar:
                members = []
                for member in tar.getmembers():
                    if member.name.startswith(prefix + "vllm/") and member.name.endswith(".py"):
                        member.name = member.name[len(prefix):]
                        members.append(member)
                tar.extractall(root, members=members, filter="data")
            sdist.unlink()  # the sources are what is kept (about a fifth of the archive)
            done.write_text(NEXT_SDIST_SHA256)
    return root


def upstream_tree(cache: Path) -> Path:
    """A folder with vLLM's ``tests/`` package, the hub stand-in and ``pytest.ini``."""
    root = cache / "vllm-upstream-tests" / VLLM_VERSION
    done = root / ".complete"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root.parent / f".{VLLM_VERSION}.lock"):  # two test runs on one machine
        if not done.exists():
            _build(root)
    return root


def _build(root: Path) -> None:
    done = root / ".complete"
    sdist = root.parent / f"vllm-{VLLM_VERSION}.tar.gz"
    if not sdist.exists() or sha256_of(sdist) != SDIST_SHA256:
        _download(sdist)
    shutil.rmtree(root / "tests", ignore_errors=True)
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix + "tests/") or member.name == prefix + "LICENSE":
                member.name = member.name[len(prefix):]
                members.append(member)
        tar.extractall(root, members=members, filter="data")
    (root / "tests/v1/conftest.py").write_text(CONFTEST_OVERLAY)
    (root / "pytest.ini").write_text(PYTEST_INI)
    model = root / "hf/hub/models--facebook--opt-125m"
    (model / "refs").mkdir(parents=True, exist_ok=True)
    (model / "refs/main").write_text("minipic-stand-in")
    snapshot = model / "snapshots/minipic-stand-in"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    done.write_text(SDIST_SHA256)
