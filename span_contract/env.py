"""Every ``MINIPIC_*`` environment variable, in one list: its default, what it changes, who
reads it.

Why one module: minipic runs in several processes (the CLI, vLLM's API server, the EngineCore,
the workers), and an environment variable is the one setting each of them inherits without
being told. Spelled in the module that reads it, a variable could only be found by grep; here
each is named once, every reader imports its name from here, ``docs/env.md`` is checked against
:data:`VARIABLES`, and a test fails when a package module spells a ``MINIPIC_*`` name itself.

Settings a user chooses have CLI flags too (``minipic serve --help``); the variables below are
how those flags reach the engine's processes, plus a few switches for operators, benchmarks and
the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as the reader treats an unset variable
    what: str  # what it changes
    read_by: str  # the module (or tool) that reads it


# -- set by minipic's own launchers for vLLM's processes ------------------------------------------
ENABLE_ENV = "MINIPIC_ENABLE"
SPAN_CONFIG_ENV = "MINIPIC_SPAN_CONFIG"
FEATURES_ENV = "MINIPIC_FEATURES"
CKPT_CONFIG_ENV = "MINIPIC_CKPT_CONFIG"
SPAN_STORE_ENV = "MINIPIC_SPAN_STORE"
# -- operators ------------------------------------------------------------------------------------
CACHE_DIR_ENV = "MINIPIC_CACHE_DIR"
CACHE_RESET_ENV = "MINIPIC_CACHE_RESET"
ALLOW_VLLM_VERSION_ENV = "MINIPIC_ALLOW_VLLM_VERSION"
CPU_PRELOAD_ENV = "MINIPIC_CPU_PRELOAD"
ENGINE_NOISE_FILTER_ENV = "MINIPIC_ENGINE_NOISE_FILTER"
MAX_BODY_MIB_ENV = "MINIPIC_MAX_BODY_MIB"
MAX_DOCUMENTS_ENV = "MINIPIC_MAX_DOCUMENTS"
MAX_DOCUMENT_CHARS_ENV = "MINIPIC_MAX_DOCUMENT_CHARS"
KEY_SHADOW_SHARE_ENV = "MINIPIC_ROTATED_POOL_SHARE"
# -- measurement and comparison -------------------------------------------------------------------
CPU_ATTN_ENV = "MINIPIC_CPU_ATTN"
HOLES_PER_STEP_ENV = "MINIPIC_HOLES_PER_STEP"
SPAN_ROWS_ENV = "MINIPIC_SPAN_ROWS"
MASKED_CHUNK_ENV = "MINIPIC_MASKED_CHUNK_KIB"
PROFILE_DIR_ENV = "MINIPIC_PROFILE_DIR"
INDEX_CHILD_ENV = "MINIPIC_INDEX_CHILD"
# -- the test suite and its tools -----------------------------------------------------------------
TEST_SEED_ENV = "MINIPIC_TEST_SEED"
TOLERANCE_LOG_ENV = "MINIPIC_TOLERANCE_LOG"
TEST_CACHE_ENV = "MINIPIC_TEST_CACHE"
TEST_LANES_FILE_ENV = "MINIPIC_TEST_LANES_FILE"
FILE_TIMES_ENV = "MINIPIC_FILE_TIMES"
TEST_SABOTAGE_ENV = "MINIPIC_TEST_SABOTAGE"
UPSTREAM_MODE_ENV = "MINIPIC_UPSTREAM_MODE"
UPSTREAM_REPORT_ENV = "MINIPIC_UPSTREAM_REPORT"
INSTALLER_ENV = "MINIPIC_INSTALLER"

VARIABLES: tuple[Variable, ...] = (
    Variable(ENABLE_ENV, "unset (off)",
             "1 turns the vLLM plugin on in this process tree; set at all (0 or 1: started by "
             "minipic), an EngineCore also stops once its parent is gone; unset, minipic leaves "
             "vLLM stock", "engine_ext/plugin.py via span_contract/span_config.py; "
             "engine_ext/vllm_surface/parent_watch.py"),
    Variable(SPAN_CONFIG_ENV, "unset",
             "the span configuration (block size, SSEP / PDEP / pad ids) as JSON, for engines "
             "started without it in vLLM's additional_config", "span_contract/span_config.py"),
    Variable(FEATURES_ENV, "hash,rope,holes",
             "which plugin features install (hash, rope, holes, ckpt)",
             "span_contract/span_config.py"),
    Variable(CKPT_CONFIG_ENV, "unset",
             "the recurrent-checkpoint plan of a hybrid model, as JSON",
             "span_contract/span_config.py"),
    Variable(SPAN_STORE_ENV, "unset (the CLI's --span-store)",
             "the span store configuration (tiers, sizes, directory) as JSON",
             "span_contract/span_store_config.py"),
    Variable(CACHE_DIR_ENV, "~/.cache/minipic",
             "where converted models, the store and downloaded assets live",
             "span_contract/models.py"),
    Variable(CACHE_RESET_ENV, "unset (off)",
             "1: expose POST /minipic/reset_prefix_cache (tests, benchmarks)",
             "engine_ext/endpoints.py"),
    Variable(ALLOW_VLLM_VERSION_ENV, "unset",
             "run the plugin on a vLLM version the patch table was not run against",
             "engine_ext/vllm_surface/patches.py"),
    Variable(CPU_PRELOAD_ENV, "1",
             "0: leave LD_PRELOAD alone instead of preloading tcmalloc and Intel OpenMP as "
             "vLLM's CPU docs ask", "span_contract/cpu_runtime.py"),
    Variable(ENGINE_NOISE_FILTER_ENV, "1",
             "0: show vLLM's start-up chatter that minipic's CLI hides",
             "minipic/engine_logs.py"),
    Variable(MAX_BODY_MIB_ENV, "32", "largest documents request body (413 above)",
             "serving/documents/bodies.py"),
    Variable(MAX_DOCUMENTS_ENV, "1024", "most documents per request (400 above)",
             "serving/documents/bodies.py"),
    Variable(MAX_DOCUMENT_CHARS_ENV, "1000000", "longest document in characters (400 above)",
             "serving/documents/bodies.py"),
    Variable(KEY_SHADOW_SHARE_ENV, "0.1",
             "share of the KV budget given to the key shadow (keys moved to another slot)",
             "engine_ext/attention/key_shadow/pool.py"),
    Variable(CPU_ATTN_ENV, "auto",
             "CPU attention path: auto (vLLM's kernel, shadow keys off home), scratch, torch",
             "engine_ext/attention/cpu_backend.py"),
    Variable(SPAN_ROWS_ENV, "kernel",
             "how a span's own tokens are attended: kernel (vLLM's kernel over a copy of the "
             "span's keys), masked (the masked torch path, the comparison of the benchmarks)",
             "engine_ext/attention/masked_rows.py"),
    Variable(MASKED_CHUNK_ENV, "65536",
             "score memory of one chunk of queries on the masked torch path, in KiB",
             "engine_ext/attention/masked_rows.py"),
    Variable(HOLES_PER_STEP_ENV, "all",
             "one: one hole per engine step (the comparison schedule of the benchmarks)",
             "engine_ext/holes/scheduler_steps.py"),
    Variable(PROFILE_DIR_ENV, "unset (off)",
             "a folder: record the step profile of every vLLM process there",
             "engine_ext/profiling/step_profile.py"),
    Variable(INDEX_CHILD_ENV, "unset",
             "1: this process is the indexer `minipic index` supervises",
             "minipic/index/cli.py"),
    Variable(TEST_SEED_ENV, "fresh per run", "replay a test run's random inputs",
             "tests/conftest.py, tools/sweep_tolerances.py"),
    Variable(TOLERANCE_LOG_ENV, "unset", "file each tolerance check appends its share to",
             "tests/support/tolerances.py, tools/sweep_tolerances.py"),
    Variable(TEST_CACHE_ENV, "user", "temp: the tests use a throw-away cache folder",
             "tests/conftest.py"),
    Variable(TEST_LANES_FILE_ENV, "set by the suite", "the lane plan shared with xdist workers",
             "tests/support/lanes.py"),
    Variable(FILE_TIMES_ENV, "unset", "write the seconds per test file as JSON",
             "tests/support/file_timing.py"),
    Variable(TEST_SABOTAGE_ENV, "unset", "which hook the integration-guard test breaks",
             "tests/support/guard_sabotage.py"),
    Variable(UPSTREAM_MODE_ENV, "stock", "vLLM's own tests with minipic stock/patched/optin",
             "tests/support/vllm_upstream/"),
    Variable(UPSTREAM_REPORT_ENV, "unset", "where the upstream-test run writes its report",
             "tests/support/vllm_upstream/"),
    Variable(INSTALLER_ENV, "uv", "pip: `make setup` installs with pip instead of uv",
             "Makefile"),
)
