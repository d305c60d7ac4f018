# Make fragment for the standalone C++ microbenchmark (csrc/bench/bench_main.cu, no torch).
# Included by the top-level Makefile; also usable alone from the repository root:
#   make -f csrc/bench/bench.mk bench-build H=128 DT=bf16      # -> build/bench/dash_bench
#   make -f csrc/bench/bench.mk bench H="64 128" BENCH_ARGS="--seqlens 2048,8192 --masks causal"
# Variables: H (head dims, space or comma separated, default 128), DT (bf16 and/or fp16, default bf16), SOFTCAP (1:
# also the soft-capped kernels, for --softcap), NVCC, CUDA_HOME, CUTLASS_DIR (a CUTLASS checkout or its include/
# folder; default: the nvidia-cutlass wheel's headers), NVCC_THREADS, BENCH_EXTRA_FLAGS (e.g. -Xptxas -v or
# -lineinfo), BENCH_LDLIBS, BENCH_ARGS (passed to dash_bench).
# Every object has its own rule, so `make -j` compiles the heavy kernel TUs in parallel. Objects live in a folder
# named after (H, DT, SOFTCAP), so switching configurations never links stale objects.

bench_mk_file := $(lastword $(MAKEFILE_LIST))
bench_saved_goal := $(.DEFAULT_GOAL)
bench_empty :=
bench_space := $(bench_empty) $(bench_empty)
bench_comma := ,

DASH_ROOT ?= $(abspath $(dir $(bench_mk_file))/../..)
H ?= 128
DT ?= bf16
NVCC ?= nvcc
PYTHON ?= python3
CUDA_HOME ?= /usr/local/cuda
BENCH_BUILD_DIR ?= $(DASH_ROOT)/build/bench
BENCH_BIN := $(BENCH_BUILD_DIR)/dash_bench
BENCH_ARGS ?=
BENCH_EXTRA_FLAGS ?=
BENCH_LDLIBS ?=

bench_hdims := $(strip $(subst $(bench_comma),$(bench_space),$(H)))
bench_dtypes := $(strip $(subst $(bench_comma),$(bench_space),$(DT)))
# SOFTCAP=1 also builds the soft-capped kernels (dash_bench --softcap C).
SOFTCAP ?= 0
bench_config := h$(subst $(bench_space),-,$(bench_hdims))_$(subst $(bench_space),-,$(bench_dtypes))$\
                $(if $(filter 1,$(SOFTCAP)),_softcap)
bench_obj_dir := $(BENCH_BUILD_DIR)/obj_$(bench_config)

# The build configuration comes from csrc/build_config.py (nvcc flags, defines, CUTLASS headers:
# $(CUTLASS_DIR)[/include], else the cutlass_library package's, located without importing it) and the kernel TUs
# from csrc/instantiations/generate.py --list. Each is evaluated once, and only when a recipe or the link needs it,
# so including this fragment never runs Python. A query that prints nothing stops make; the
# script says why on stderr.
bench_py = $(or $(shell $(1) $(PYTHON) $(DASH_ROOT)/$(strip $(2))),$(error bench.mk: $(PYTHON) $(strip $(2)): no answer))
BENCH_CUTLASS_INC = $(eval BENCH_CUTLASS_INC := $(call bench_py,CUTLASS_DIR="$(CUTLASS_DIR)",\
                      csrc/build_config.py --cutlass-include))$(BENCH_CUTLASS_INC)
BENCH_DEFINES = $(eval BENCH_DEFINES := $(call bench_py,,csrc/build_config.py --defines --hdims $(bench_hdims) \
                  --dtypes $(bench_dtypes) $(if $(filter 1,$(SOFTCAP)),--softcap)))$(BENCH_DEFINES)
BENCH_NVCC_FLAGS ?= $(eval BENCH_NVCC_FLAGS := $(call bench_py,,csrc/build_config.py --nvcc-flags))$(BENCH_NVCC_FLAGS)
bench_threads := $(if $(NVCC_THREADS),--threads $(NVCC_THREADS))

bench_inst_srcs = $(eval bench_inst_srcs := $(call bench_py,,csrc/instantiations/generate.py --list \
                    --prefix csrc/instantiations/ --layouts batched --hdims $(bench_hdims) --dtypes $(bench_dtypes) \
                    --score-mods none $(if $(filter 1,$(SOFTCAP)),softcap)))$(bench_inst_srcs)
bench_srcs = csrc/bench/bench_main.cu csrc/fwd/fwd_dispatch.cu csrc/bwd/bwd_dispatch.cu $(bench_inst_srcs)
bench_objs = $(patsubst %.cu,$(bench_obj_dir)/%.o,$(bench_srcs))

$(bench_obj_dir)/%.o: $(DASH_ROOT)/%.cu
	@mkdir -p $(@D)
	CPLUS_INCLUDE_PATH=$(CUDA_HOME)/include/cccl$${CPLUS_INCLUDE_PATH:+:$$CPLUS_INCLUDE_PATH} \
	  $(NVCC) $(BENCH_NVCC_FLAGS) $(bench_threads) $(BENCH_EXTRA_FLAGS) $(BENCH_DEFINES) \
	  -I$(DASH_ROOT)/csrc -I$(BENCH_CUTLASS_INC) -MMD -MP -c $< -o $@

# The object list runs Python, so it is only computed where the binary is wanted: goals bench, bench-build or the
# binary itself, or no goal when this fragment is the makefile (its default goal is bench-build).
bench_goals := $(or $(MAKECMDGOALS),$(if $(filter $(bench_mk_file),$(firstword $(MAKEFILE_LIST))),bench-build))
$(bench_obj_dir)/dash_bench: $(if $(filter bench bench-build %/dash_bench,$(bench_goals)),$(bench_objs))
	$(NVCC) $^ -o $@ $(BENCH_LDLIBS)

# The copy is unconditional and cheap: build/bench/dash_bench is always the configuration just asked for.
bench-build: $(bench_obj_dir)/dash_bench
	cp -f $< $(BENCH_BIN)
	@echo "built $(BENCH_BIN) (hdims: $(bench_hdims); dtypes: $(bench_dtypes))"

bench: bench-build
	$(BENCH_BIN) $(BENCH_ARGS)

bench-clean:
	rm -rf $(BENCH_BUILD_DIR)

.PHONY: bench-build bench bench-clean

# The header dependencies of the objects built so far (only this configuration's are in its folder).
-include $(wildcard $(bench_obj_dir)/csrc/*/*.d)

# Included: leave the including Makefile's default goal alone. Alone (make -f csrc/bench/bench.mk): build.
ifeq ($(firstword $(MAKEFILE_LIST)),$(bench_mk_file))
.DEFAULT_GOAL := bench-build
else
.DEFAULT_GOAL := $(bench_saved_goal)
endif
