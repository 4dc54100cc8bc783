"""Offline model provisioning: atomic conversion, and one-line errors that name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minipic.span_contract import models
from minipic.span_contract.env import CACHE_DIR_ENV

pytestmark = pytest.mark.fast


def test_default_model_is_converted_and_complete():
    folder = models.default_model_dir(fetch=False)
    assert (folder / models.COMPLETE_MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and "quantization_config" not in config
    assert (folder / "tokenizer.json").is_file()


def test_crash_mid_conversion_leaves_nothing_taken_as_good(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    target = tmp_path / "models" / "thing"
    target.parent.mkdir(parents=True)

    def crashing_build(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # a crash / Ctrl-C mid-way

    with pytest.raises(KeyboardInterrupt):
        models._publish(crashing_build, target)
    assert not target.exists()
    assert not list(target.parent.glob(".partial-*"))
    # a leftover folder without the marker (e.g. from a killed process) is never trusted
    target.mkdir()
    (target / "config.json").write_text("{}")
    built = models._publish(lambda tmp: (tmp / "ok").write_text("1"), target)
    assert (built / "ok").is_file() and (built / models.COMPLETE_MARKER).is_file()
    assert not (built / "config.json").exists()


def test_corrupted_gguf_gives_one_line_error(tmp_path, monkeypatch):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(models, "locate_gguf", lambda: bad)
    with pytest.raises(models.ModelUnavailableError) as err:
        models.default_model_dir()
    message = str(err.value)
    assert "corrupted" in message and "minipic models fetch --force" in message
    assert "\n" not in message


def test_missing_package_names_the_fixing_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(models.ModelUnavailableError, match="minipic models fetch"):
        models.default_model_dir(fetch=False)


def test_unwritable_cache_dir_is_a_clear_cli_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    env = {CACHE_DIR_ENV: str(blocker / "sub"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "minipic.cli", "models", "fetch"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.startswith("minipic: error: cannot create model cache dir")
    assert "Traceback" not in out.stderr


def test_tiny_models_are_deterministic():
    a = models.tiny_llama_dir(seed=0)
    assert a == models.tiny_llama_dir(seed=0)
    config = json.loads((a / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    q = json.loads((models.tiny_qwen3_next_dir() / "config.json").read_text())
    assert q["layer_types"].count("linear_attention") == 3


def test_cli_help_explains_commands():
    out = subprocess.run([sys.executable, "-m", "minipic.cli", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for command in ("models", "serve", "demo", "plan"):
        assert command in out.stdout


def test_tiny_model_folder_names_what_built_it(monkeypatch):
    """A tiny model built by an earlier run is reused only if config, seed, tokenizer, builder
    code and library versions are all the same (issue: a shared cache reused whatever changed).
    """
    import transformers

    key = models._config_key("llama", {"a": 1}, 0, Path("tok-1"))
    assert key == models._config_key("llama", {"a": 1}, 0, Path("tok-1"))
    assert key != models._config_key("llama", {"a": 2}, 0, Path("tok-1"))
    assert key != models._config_key("llama", {"a": 1}, 1, Path("tok-1"))
    assert key != models._config_key("llama", {"a": 1}, 0, Path("tok-2"))
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    assert key != models._config_key("llama", {"a": 1}, 0, Path("tok-1"))
    monkeypatch.undo()
    import inspect

    real = inspect.getsource

    def edited(obj):  # the builder's code as if someone changed it
        text = real(obj)
        return text + "# changed" if obj is models._init_random else text

    monkeypatch.setattr(inspect, "getsource", edited)
    assert key != models._config_key("llama", {"a": 1}, 0, Path("tok-1"))


def test_no_test_module_changes_the_environment_at_import():
    """The cache (and every other setting) is chosen once in conftest's ``pytest_configure``;
    a module-level ``os.environ`` write would make a test's view depend on import order."""
    import ast

    offenders = []
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: fixtures and functions may set env
            for sub in ast.walk(node) if not isinstance(
                    node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else ():
                text = ast.unparse(sub) if isinstance(sub, ast.Call | ast.Assign) else ""
                if "os.environ" in text and any(
                        w in text for w in ("setdefault", "update(", "] =", "putenv", "pop(")):
                    offenders.append(f"{path.name}:{sub.lineno}: {text[:60]}")
    assert not offenders, offenders
