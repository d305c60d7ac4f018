# dash_attn developer entry points. `make demo` is the main job, `make test` the test command CI runs.
SHELL := /bin/bash
PYTHON ?= python3
PIP := $(PYTHON) -m pip
NVCC ?= nvcc
CHECK_HDIM ?= 128
CHECK_DTYPE ?= bf16
# The build configuration is csrc/build_config.py's (nvcc flags, defines, where CUTLASS is) and the
# instantiation files are csrc/instantiations/generate.py's (`--list`): both run only when a recipe needs them.
# $(call run_py,ARGS): what `$(PYTHON) ARGS` prints; printing nothing stops make (the script said why on stderr).
run_py = $(or $(shell $(PYTHON) $(1)),$(error $(PYTHON) $(1): no answer))
# $(call inst_list,FILTERS): the instantiation TUs that generate.py's axis table has for FILTERS.
inst_list = $(call run_py,csrc/instantiations/generate.py --list --prefix csrc/instantiations/ $(1))
# Evaluated once, at the first use: $(CUTLASS_DIR) (a CUTLASS checkout or its include/ folder), else the wheel's.
CUTLASS_INC = $(eval CUTLASS_INC := $(shell CUTLASS_DIR="$(CUTLASS_DIR)" $(PYTHON) csrc/build_config.py \
	--cutlass-include))$(or $(CUTLASS_INC),$(error CUTLASS headers not found))
NVCC_COMMON_FLAGS = $(eval NVCC_COMMON_FLAGS := $(call run_py,csrc/build_config.py --nvcc-flags))$(NVCC_COMMON_FLAGS)
NVCC_FLAGS = $(NVCC_COMMON_FLAGS) -Icsrc -I$(CUTLASS_INC) \
	$(call run_py,csrc/build_config.py --defines --hdims $(CHECK_HDIM) --dtypes $(CHECK_DTYPE))
export CPLUS_INCLUDE_PATH := /usr/local/cuda/include/cccl:$(CPLUS_INCLUDE_PATH)

.PHONY: runtime deps install dev gen test test-gpu fa3-suite check-kernels prebuild demo bench clean

# What the package needs to run; torch only when missing (a CPU machine gets the CPU build, a GPU node keeps its own).
runtime:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PIP) install -q numpy

# What the tests and the build need on top.
deps: runtime
	@$(PIP) install -q pytest pybind11 ninja matplotlib "setuptools>=77" wheel

install: deps
	$(PIP) install -q --no-deps -r third_party/requirements-cutlass.txt || echo "nvidia-cutlass not installed (offline?): set CUTLASS_DIR"
	$(PIP) install --no-build-isolation --no-deps -e .

# One head dim and dtype: a fast edit-compile-test loop on a GPU node.
dev:
	DASH_ATTN_HDIMS=$(CHECK_HDIM) DASH_ATTN_DTYPES=$(CHECK_DTYPE) $(PIP) install --no-build-isolation --no-deps -e .

gen:
	$(PYTHON) csrc/instantiations/generate.py

test: deps
	$(PIP) install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest -q

test-gpu:
	timeout 900 $(PYTHON) -m pytest -q -m gpu

# FlashAttention-3's own hopper/test_flash_attn.py, unedited, against the built package (tests/fa3_suite/run.py):
# FA3_HOPPER is a FlashAttention checkout's hopper/ folder, kept outside the repo; FA3_HDIMS/FA3_DTYPES narrow the
# kernel head dims and dtypes (default: the built ones); FA3_SUITE_ARGS adds run.py options (--workers 8 --budget 200).
FA3_SUITE_OUT ?= build/fa3_suite
fa3-suite:
	$(PYTHON) tests/fa3_suite/run.py --fa3 "$(FA3_HOPPER)" --out $(FA3_SUITE_OUT) $(if $(FA3_HDIMS),--hdims $(FA3_HDIMS)) \
	    $(if $(FA3_DTYPES),--dtypes $(FA3_DTYPES)) $(FA3_SUITE_ARGS)

# Compile the kernel TUs of one (hdim, dtype) without a GPU and fail on register spills or stack frames beyond the
# measured allowances listed in csrc/tools/check_spills.py. First, the backward traits of every head dim, dtype and
# mask are instantiated (types only, ~30 s): their static_asserts cover the head dims not compiled here.
# CHECK_SCORE_MODS: none (plain kernels) and/or softcap (the soft-capped ones); CHECK_LAYOUTS: batched and/or packed
# (the varlen kernels).
CHECK_DIRECTIONS ?= fwd bwd
CHECK_MASKS ?= full causal window
CHECK_SCORE_MODS ?= none softcap
CHECK_LAYOUTS ?= batched
check-kernels:
	@mkdir -p build/check
	@echo "== csrc/tools/check_traits.cu"; $(NVCC) $(NVCC_FLAGS) -c csrc/tools/check_traits.cu -o build/check/check_traits.o
	@set -o pipefail; for f in $(call inst_list,--layouts $(CHECK_LAYOUTS) --directions $(CHECK_DIRECTIONS) \
	    --hdims $(CHECK_HDIM) --dtypes $(CHECK_DTYPE) --masks $(CHECK_MASKS) --score-mods $(CHECK_SCORE_MODS)); do \
	  echo "== $$f"; $(NVCC) $(NVCC_FLAGS) -Xptxas -v -c $$f -o build/check/$$(basename $$f .cu).o 2>&1 \
	    | $(PYTHON) csrc/tools/check_spills.py || exit 1; done

# Kernel objects (torch-free) for DASH_ATTN_PREBUILT_DIR=build/prebuilt: compile on a CPU machine, link on the GPU node
# (the instantiations only: setup.py compiles the dispatch TUs for the head dims and dtypes it builds).
# PREBUILD_SOFTCAP=0 leaves out the soft-capped kernels (as DASH_ATTN_SOFTCAP=0 does for setup.py), PREBUILD_PACKED=0
# the packed-sequence ones (as DASH_ATTN_PACKED=0);
# PREBUILD_EXTRA adds nvcc flags (e.g. "-Xptxas -v" for the resource reports).
PREBUILD_HDIMS ?= 64 128
PREBUILD_DTYPES ?= bf16 fp16
PREBUILD_SOFTCAP ?= 1
PREBUILD_PACKED ?= 1
PREBUILD_DEFS = $(eval PREBUILD_DEFS := $(call run_py,csrc/build_config.py --defines --hdims $(PREBUILD_HDIMS) \
	--dtypes $(PREBUILD_DTYPES) $(if $(filter 0,$(PREBUILD_SOFTCAP)),,--softcap) \
	$(if $(filter 0,$(PREBUILD_PACKED)),,--packed)))$(PREBUILD_DEFS)
PREBUILD_SRCS = $(call inst_list,--hdims $(PREBUILD_HDIMS) --dtypes $(PREBUILD_DTYPES) \
	--score-mods none $(if $(filter 0,$(PREBUILD_SOFTCAP)),,softcap) \
	--layouts batched $(if $(filter 0,$(PREBUILD_PACKED)),,packed))
PREBUILD_OBJS = $(patsubst %.cu,build/prebuilt/%.o,$(notdir $(PREBUILD_SRCS)))
vpath %.cu csrc/instantiations

# The object list runs Python, so it is only computed where prebuild is a goal.
prebuild: $(if $(filter prebuild,$(MAKECMDGOALS)),$(PREBUILD_OBJS))

build/prebuilt/%.o: %.cu
	@mkdir -p build/prebuilt
	$(NVCC) $(NVCC_COMMON_FLAGS) -Icsrc -I$(CUTLASS_INC) $(PREBUILD_DEFS) $(PREBUILD_EXTRA) -Xcompiler -fPIC -c $< -o $@

# The first command on a fresh machine: it installs the package (the schedule engine's CPU module always, the kernels
# where torch has CUDA and nvcc is present), then trains on an sm90 GPU, else on the CPU reference path.
demo: install
	$(PYTHON) examples/demo.py $(DEMO_ARGS)

-include csrc/bench/bench.mk

clean:
	rm -rf build dist *.egg-info dash_attn/*.so
