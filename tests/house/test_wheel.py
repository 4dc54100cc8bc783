"""The wheel a user installs: one import name, nothing shared with other packages, and it works.

Every other test imports the checkout (through the editable install), so only this one sees what
``pip install minipic`` gives. It builds the wheel and the sdist with setuptools' own build hooks
(no network), installs the wheel without ``-e`` into a fresh venv outside the checkout (the
source tree must not shadow it) that reuses the set-up's installed dependencies but not its
editable minipic, and checks there:

* the wheel's top-level names are ``minipic`` and its dist-info, nothing else;
* ``minipic`` and the entry points resolve inside that venv, every public module imports, and
  ``minipic --help`` / ``minipic serve --help`` run;
* vLLM finds the plugin through its entry points (``vllm.plugins.load_plugins_by_group``);
* the engine-code hash in the store's fingerprint follows an edit of an installed engine file;
* Hugging Face's ``kernels`` (pinned), installed beside it, owns no file minipic owns, and
  uninstalling it leaves minipic whole;
* the sdist holds what a build needs and no ``results/`` file, and builds the same package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HF_KERNELS = "kernels==0.19.1"  # transformers' hub-kernels package, imported as `kernels`
PUBLIC_MODULES = ("minipic", "minipic.orchestrator", "minipic.prompt_builder",
                  "minipic.span_contract", "minipic.serving", "minipic.kernels",
                  "minipic.checkpoint_planner", "minipic.engine_ext",
                  "minipic.engine_ext.plugin", "minipic.integrations.langchain",
                  "minipic.integrations.llamaindex", "minipic.cli")


def _clean_copy(dest: Path) -> Path:
    """The tracked files of the checkout, links kept as links: what a fresh clone builds from
    (and the build's ``build/`` and ``*.egg-info`` stay out of the checkout)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return dest


def _build(kind: str, out: Path, cwd: Path) -> Path:
    """setuptools' PEP 517 hook in a subprocess (the build system the project declares)."""
    code = (f"from setuptools import build_meta; "
            f"print(build_meta.build_{kind}({str(out)!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


def _install(target: Path, *args: str, uninstall: bool = False) -> list[str]:
    """The command that installs (or uninstalls) ``args`` into the venv ``target``: uv where
    the set-up has it (seconds), pip otherwise."""
    python = str(target / "bin" / "python")
    uv = Path(sys.executable).with_name("uv")
    if uv.exists():
        return [str(uv), "pip", "uninstall" if uninstall else "install", "--python", python,
                *args]
    pip = [sys.executable, "-m", "pip", "--python", python]
    return [*pip, "uninstall", "-y", *args] if uninstall else [*pip, "install", *args]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[dict]:
    work = tmp_path_factory.mktemp("wheel")
    dist = work / "dist"
    dist.mkdir()
    source = _clean_copy(work / "source")
    wheel = _build("wheel", dist, source)
    sdist = _build("sdist", dist, source)
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=work).stdout.strip())
    # the set-up's dependencies, not its editable minipic: a plain path entry (no .pth of that
    # folder runs, so setuptools' editable finder never loads there)
    (site / "setup_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(_install(venv, "--no-deps", str(wheel)), cwd=work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    yield {"work": work, "wheel": wheel, "sdist": sdist, "venv": venv, "py": py,
           "site": site, "env": env}
    shutil.rmtree(work, ignore_errors=True)


def _python(installed: dict, code: str, timeout: float = 300) -> str:
    """Run ``code`` with the venv's python, outside the checkout."""
    return _run([str(installed["py"]), "-c", code], cwd=installed["work"],
                env=installed["env"], timeout=timeout).stdout


def test_the_wheel_installs_one_import_name(installed) -> None:
    with zipfile.ZipFile(installed["wheel"]) as whl:
        names = whl.namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"minipic", "minipic-0.1.0.dist-info"}, sorted(top)
    for layer in ("engine_ext", "kernels", "orchestrator", "prompt_builder", "serving",
                  "span_contract", "integrations", "checkpoint_planner"):
        assert f"minipic/{layer}/__init__.py" in names, layer  # links became folders
    assert not [n for n in names if n.startswith(("tests/", "results/"))]


def test_public_modules_entry_points_and_help_run_from_the_venv(installed) -> None:
    site = str(installed["site"])
    report = json.loads(_python(installed, (
        "import importlib, json, sys\n"
        "from importlib.metadata import entry_points\n"
        f"mods = {PUBLIC_MODULES!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "eps = {g: [(e.name, e.value, e.load().__module__) for e in entry_points(group=g)\n"
        "           if e.name == 'minipic']\n"
        "       for g in ('vllm.general_plugins', 'vllm.endpoint_plugins', 'console_scripts')}\n"
        "import minipic\n"
        "print(json.dumps({'files': files, 'eps': eps, 'sdk': minipic.Orchestrator.__module__}))\n"
    )))
    outside = [m for m, f in report["files"].items() if not f.startswith(site)]
    assert not outside, (outside, report["files"])
    assert report["sdk"] == "minipic.orchestrator.client"
    eps = report["eps"]
    assert eps["vllm.general_plugins"] == [["minipic", "minipic.engine_ext.plugin:register",
                                            "minipic.engine_ext.plugin"]]
    assert eps["vllm.endpoint_plugins"][0][1] == (
        "minipic.serving.api_endpoints:MinipicServerEndpoints")
    assert eps["console_scripts"][0][1] == "minipic.cli:main"
    cli = installed["venv"] / "bin" / "minipic"
    assert cli.exists()
    for argv in ([str(cli), "--help"], [str(cli), "serve", "--help"]):
        out = _run(argv, cwd=installed["work"], env=installed["env"]).stdout
        assert "usage: minipic" in out, argv
    # vLLM's own plugin loader finds it through the entry point, in the venv
    found = _python(installed, (
        "import os\nos.environ['VLLM_PLUGINS'] = 'minipic'\n"
        "from vllm.plugins import load_plugins_by_group\n"
        "plugins = load_plugins_by_group('vllm.general_plugins')\n"
        "print(plugins['minipic'].__module__, plugins['minipic'].__code__.co_filename)\n"))
    module, filename = found.split()
    assert module == "minipic.engine_ext.plugin" and filename.startswith(site), found


def test_the_engine_code_hash_follows_an_installed_engine_file(installed) -> None:
    code = ("from minipic.span_contract.engine_config import package_root, plugin_code_hash\n"
            "print(package_root(), plugin_code_hash())\n")
    root, before = _python(installed, code).split()
    assert root == str(installed["site"] / "minipic")
    engine_file = installed["site"] / "minipic" / "engine_ext" / "plugin.py"
    original = engine_file.read_text()
    try:
        engine_file.write_text(original + "\n# an edit\n")
        assert _python(installed, code).split()[1] != before
    finally:
        engine_file.write_text(original)
    assert _python(installed, code).split()[1] == before


def _record(site: Path, dist: str) -> set[str]:
    info = next(site.glob(f"{dist}-*.dist-info"))
    return {line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line}


def test_hf_kernels_beside_it_shares_no_file_and_leaves_it_whole(installed) -> None:
    site, work = installed["site"], installed["work"]
    _run(_install(installed["venv"], "--no-deps", HF_KERNELS), cwd=work)
    ours, theirs = _record(site, "minipic"), _record(site, "kernels")
    assert not ours & theirs, sorted(ours & theirs)[:10]
    assert (site / "kernels" / "__init__.py").exists()  # theirs, at the top level
    _run(_install(installed["venv"], "kernels", uninstall=True), cwd=work)
    assert not (site / "kernels").exists()
    missing = [f for f in ours if not (site / f).exists()]
    assert not missing, missing[:10]
    out = _python(installed, "from minipic.kernels import rotate; print(rotate.__module__)")
    assert out.strip() == "minipic.kernels.rope"


def test_the_sdist_holds_a_build_and_no_results(installed, tmp_path) -> None:
    with tarfile.open(installed["sdist"]) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path, filter="data")
    top = installed["sdist"].name.removesuffix(".tar.gz")
    inside = {name.split("/", 1)[1] for name in names if "/" in name}
    assert {"pyproject.toml", "README.md", "minipic/__init__.py",
            "minipic/engine_ext/plugin.py", "minipic/kernels/rope.py"} <= inside
    assert not [n for n in inside if n.startswith("results/") or "/results/" in n]
    out = tmp_path / "out"
    out.mkdir()
    rebuilt = _build("wheel", out, cwd=tmp_path / top)
    with zipfile.ZipFile(rebuilt) as a, zipfile.ZipFile(installed["wheel"]) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
