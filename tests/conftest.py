"""Shared fixtures: real vLLM engines, embedded orchestrators and `minipic serve` processes,
each started once per run and shared by every module that declares it
(``pytest.mark.shares``, ``tests/support/shared_resources.py``), and the run's environment.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from support import lanes
from support.engine_profiles import ENGINE_PROFILES
from support.file_timing import (
    LANES_OUTPUT,
    STARTS_KEY,
    pytest_runtest_logreport,
    pytest_terminal_summary,
    pytest_testnodedown,
    send_from_worker,
)
from support.seeds import fresh_seed
from support.servers import SCRATCH, ServerProcess
from support.shared_resources import SharedResources, declared, module_id, order_modules

from minipic.span_contract.env import CACHE_DIR_ENV, SPAN_STORE_ENV, TEST_CACHE_ENV

__all__ = ["pytest_runtest_logreport", "pytest_terminal_summary",  # per-file times
           "pytest_testnodedown"]

CACHE_ENV = CACHE_DIR_ENV


def choose_cache(config: pytest.Config) -> tuple[str, str]:
    """The model cache every test and every process it starts uses: ``(path, why)``.

    Chosen once per run, explicitly, before collection (test modules and the servers they start
    read it), never by which module happened to be imported first:

    * ``MINIPIC_CACHE_DIR`` set by the caller: that folder;
    * ``MINIPIC_TEST_CACHE=temp``: a fresh folder of this run (every model is built again:
      slower, nothing carried over from earlier runs);
    * otherwise the user cache that ``make setup`` filled (``minipic models fetch``). Its
      folders are keyed by what built them (the GGUF's sha256; a tiny model's config, seed,
      builder code and transformers version), so a change never reuses a stale build.
    """
    from minipic.span_contract.models import cache_root

    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV], f"{CACHE_ENV} (set by the caller)"
    choice = os.environ.get(TEST_CACHE_ENV, "user")
    if choice == "temp":
        path = tempfile.mkdtemp(prefix="minipic-test-cache-")
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
        return path, f"{TEST_CACHE_ENV}=temp (this run only, removed after it)"
    if choice != "user":
        raise pytest.UsageError(f"{TEST_CACHE_ENV}={choice!r}: expected 'user' or 'temp'")
    return str(cache_root()), "the user cache (make setup)"


def pytest_configure(config: pytest.Config) -> None:
    """The run's environment, set once before any test module is imported."""
    import torch

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        # The Triton kernel's tests (and the CUDA backend's glue test) run in Triton's CPU
        # interpreter. Triton picks interpreter vs compiler when @triton.jit wraps a function
        # (its own tl.* helpers at `import triton`), so this must precede Triton's first
        # import, whichever module imports it. vLLM on CPU does not use Triton.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    path, why = choose_cache(config)
    os.environ[CACHE_ENV] = path
    config.stash[_CACHE_KEY] = f"minipic model cache: {path} — {why}"
    # `minipic serve` keeps a span store by default (in the user's cache); the suite's servers
    # do not, so that what they cache is their pool alone and nothing lands in that cache.
    # Tests of the store pass --span-store DIR; the default itself: test_span_store_config.
    os.environ.setdefault(SPAN_STORE_DEFAULT_ENV, "off")
    # One scratch folder per run for what engines and servers leave on disk: vLLM's ZMQ IPC
    # sockets (a killed engine cannot unlink them) and the servers' logs; removed at the end,
    # logs kept when a test failed.
    scratch = Path(tempfile.mkdtemp(prefix="minipic-tests-"))
    (scratch / "ipc").mkdir()
    (scratch / "logs").mkdir()
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(scratch / "ipc"))
    # an xdist controller: its workers (started after this) publish their lanes here
    os.environ.setdefault(lanes.FILE_ENV, str(scratch / "lanes.json"))
    SCRATCH[:] = [scratch]


SPAN_STORE_DEFAULT_ENV = SPAN_STORE_ENV
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    send_from_worker(session.config)
    if not SCRATCH:
        return
    scratch = SCRATCH[0]
    shutil.rmtree(scratch / "ipc", ignore_errors=True)
    if exitstatus == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    elif scratch.exists():
        print(f"\nminipic: server logs of this run: {scratch / 'logs'}")


_CACHE_KEY = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    return config.stash.get(_CACHE_KEY, "")

# Run order of the shared resources: the modules that use each one run side by side
# (shared_resources.order_modules); at most SHARED_CAP are up at once (~3 GiB each).
RESOURCE_ORDER = ["tiny_stock", "tiny_pic", "tiny_hash_only", "smol_pic", "smol_stock",
                  "smol_server", "tiny_orchestrator", "family_engines", *(n for n in ENGINE_PROFILES
                                                       if n.startswith("qwen3next"))]
SHARED_CAP = 3
SHARED = SharedResources(SHARED_CAP)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    if config.getoption(SWEEP_OPTION):
        swept = [i for i in items if "seed" in getattr(i, "fixturenames", ())]
        kept = {id(i) for i in swept}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
        items[:] = swept
    items[:] = order_modules(items, RESOURCE_ORDER)
    lane_of = assign_lanes(config, items)
    SHARED.plan(items, lane_of)
    config.stash[STARTS_KEY] = SHARED.starts


def worker_count(config: pytest.Config) -> int:
    """How many xdist workers split this run into lanes (1: not an xdist run)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput.get("workercount", 1)) if workerinput else 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n N``: N lanes of whole modules, one per worker (``tests/support/lanes.py``)."""
    return lanes.scheduler(config, log)


def assign_lanes(config: pytest.Config, items: list[pytest.Item]) -> dict[str, int]:
    """One lane of whole modules per xdist worker (``tests/support/lanes.py``), published for the
    controller's scheduler; every module in lane 0 when the run is not split."""
    modules: dict[str, set[str]] = {}
    for item in items:
        modules.setdefault(module_id(item), set()).update(declared(item))
    count = worker_count(config)
    if count == 1:
        return dict.fromkeys(modules, 0)
    times = lanes.load_times()
    lane_of = lanes.assign(modules, lambda m: frozenset(modules[m]), count, times)
    lanes.publish(lane_of)
    seconds = lanes.estimated_seconds(lane_of, lambda m: frozenset(modules[m]), count, times)
    config.workeroutput[LANES_OUTPUT] = {
        f"lane{lane}": {"estimated_s": round(seconds[lane]),
                        "modules": [m for m in modules if lane_of[m] == lane]}
        for lane in range(count)}
    return lane_of



@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    SHARED.enter(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # the module's own fixtures are gone once its last test tore down
    if nextitem is None or nextitem.path != item.path:
        SHARED.leave_module(module_id(item))
    return result


def pytest_unconfigure(config: pytest.Config) -> None:
    SHARED.close()


class EnginePool:
    """In-process engines by profile name (``ENGINE_PROFILES``), shared through ``SHARED``."""

    def get(self, profile: str) -> Any:
        from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm

        settings = EngineSettings(max_model_len=2048, **ENGINE_PROFILES[profile])
        return SHARED.get(profile, lambda: build_llm(settings), close_llm, refetched=True)


SWEEP_OPTION = "--seed-sweep"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(SWEEP_OPTION, type=int, default=0, metavar="N",
                     help="run every test that takes `seed` with N fresh seeds, and only those "
                          "(tools/sweep_tolerances.py)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    n = metafunc.config.getoption(SWEEP_OPTION)
    if n and "seed" in metafunc.fixturenames:
        rng = random.SystemRandom()
        metafunc.parametrize("seed", [rng.randrange(2**31) for _ in range(n)],
                             ids=[f"sweep{i}" for i in range(n)])


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (fresh random inputs every run); MINIPIC_TEST_SEED replays one."""
    return fresh_seed()


@pytest.fixture
def rng(seed: int) -> random.Random:
    """A ``random.Random`` of the test's fresh seed (printed, so a failure replays)."""
    print(f"seed={seed}")
    return random.Random(seed)


@pytest.fixture
def logs() -> Any:
    """The span store logger's records during the test (``support.store_tiers.Records``)."""
    import logging

    from support.store_tiers import LOGGER, Records

    log = logging.getLogger(LOGGER)
    handler, level = Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture(scope="module")
def model_dir() -> Any:
    """The default model's folder, without converting it (the prompt builder's tests need its
    tokenizer only; ``make setup`` converts it)."""
    from minipic.span_contract.models import ModelUnavailableError, default_model_dir

    try:
        return default_model_dir(fetch=False)
    except ModelUnavailableError as exc:
        pytest.skip(f"default model not converted: {exc}")


@pytest.fixture(scope="session")
def engines() -> EnginePool:
    return EnginePool()


@pytest.fixture(scope="module")
def smol_server() -> ServerProcess:
    """`minipic serve` with the default model and the plugin on, shared by the modules that
    declare it (no server flags of their own: a module that needs some starts its own)."""
    return SHARED.get("smol_server", lambda: ServerProcess("--max-model-len", "2048").start(),
                      ServerProcess.stop)


@pytest.fixture(scope="module")
def family_engines() -> Any:
    """The process that starts each model family's tiny engine in-process, one at a time
    (``support/family_checks.FamilyRunner``), shared by the family modules that declare it."""
    from support.family_checks import FamilyRunner

    return SHARED.get("family_engines", FamilyRunner, FamilyRunner.close)


@pytest.fixture(scope="module")
def tiny_orchestrator() -> Any:
    """ONE embedded orchestrator (tiny random Llama, plugin on), shared by the modules that
    declare it. A test that changes its options puts them back.

    A ``SyncOrchestrator``: the engine lives on the facade's own loop thread, so sync tests call
    its methods and async code runs coroutines there with ``submit`` (an embedded engine is bound
    to one event loop, and pytest-asyncio gives each test its own).
    """
    from minipic.orchestrator import SyncOrchestrator

    return SHARED.get("tiny_orchestrator",
                      lambda: SyncOrchestrator.embedded("tiny-llama", max_model_len=2048),
                      SyncOrchestrator.close)
