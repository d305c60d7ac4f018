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
bench_masks := full causal window
# SOFTCAP=1 also builds the soft-capped kernels (dash_bench --softcap C).
SOFTCAP ?= 0
bench_mods := $(if $(filter 1,$(SOFTCAP)),_none _softcap,_none)
bench_config := h$(subst $(bench_space),-,$(bench_hdims))_$(subst $(bench_space),-,$(bench_dtypes))$\
                $(if $(filter 1,$(SOFTCAP)),_softcap)
bench_obj_dir := $(BENCH_BUILD_DIR)/obj_$(bench_config)

# CUTLASS headers: $(CUTLASS_DIR)[/include], else located from the cutlass_library package without importing it.
# Evaluated once, and only when a recipe needs it, so including this fragment never runs Python.
bench_cutlass_query := import importlib.util as u, os; s = u.find_spec('cutlass_library'); \
  print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')
bench_cutlass_from_dir = $(if $(wildcard $(CUTLASS_DIR)/include/cute),$(CUTLASS_DIR)/include,$(CUTLASS_DIR))
bench_cutlass_from_pkg = $(shell $(PYTHON) -c "$(bench_cutlass_query)" 2>/dev/null)
bench_find_cutlass = $(if $(strip $(CUTLASS_DIR)),$(bench_cutlass_from_dir),$(bench_cutlass_from_pkg))
BENCH_CUTLASS_INC = $(eval BENCH_CUTLASS_INC := $(bench_find_cutlass))$(BENCH_CUTLASS_INC)

bench_upper = $(subst bf,BF,$(subst fp,FP,$(1)))
BENCH_DEFINES := $(foreach h,$(bench_hdims),-DDASH_ENABLE_HDIM_$(h)) \
                 $(foreach t,$(bench_dtypes),-DDASH_ENABLE_$(call bench_upper,$(t))) \
                 $(if $(filter 1,$(SOFTCAP)),-DDASH_ENABLE_SOFTCAP)
BENCH_NVCC_FLAGS ?= -std=c++17 -O3 --use_fast_math -gencode arch=compute_90a,code=sm_90a \
                    --expt-relaxed-constexpr --expt-extended-lambda
bench_threads := $(if $(NVCC_THREADS),--threads $(NVCC_THREADS))

bench_inst_srcs := $(foreach dir,fwd bwd,$(foreach h,$(bench_hdims),$(foreach t,$(bench_dtypes),\
                     $(foreach m,$(bench_masks),$(foreach s,$(bench_mods),\
                     csrc/instantiations/$(dir)_hdim$(h)_$(t)_$(m)$(s:_none=).cu)))))
bench_srcs := csrc/bench/bench_main.cu csrc/fwd/fwd_dispatch.cu csrc/bwd/bwd_dispatch.cu $(bench_inst_srcs)
bench_objs := $(patsubst %.cu,$(bench_obj_dir)/%.o,$(bench_srcs))

$(bench_obj_dir)/%.o: $(DASH_ROOT)/%.cu
	@mkdir -p $(@D)
	@test -d "$(BENCH_CUTLASS_INC)/cute" || { echo "bench.mk: CUTLASS headers not found ('$(BENCH_CUTLASS_INC)'):" \
	  "set CUTLASS_DIR, or pip install --no-deps nvidia-cutlass==4.2.0.0 (see third_party/)" >&2; exit 1; }
	CPLUS_INCLUDE_PATH=$(CUDA_HOME)/include/cccl$${CPLUS_INCLUDE_PATH:+:$$CPLUS_INCLUDE_PATH} \
	  $(NVCC) $(BENCH_NVCC_FLAGS) $(bench_threads) $(BENCH_EXTRA_FLAGS) $(BENCH_DEFINES) \
	  -I$(DASH_ROOT)/csrc -I$(BENCH_CUTLASS_INC) -MMD -MP -c $< -o $@

$(bench_obj_dir)/dash_bench: $(bench_objs)
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

-include $(bench_objs:.o=.d)

# Included: leave the including Makefile's default goal alone. Alone (make -f csrc/bench/bench.mk): build.
ifeq ($(firstword $(MAKEFILE_LIST)),$(bench_mk_file))
.DEFAULT_GOAL := bench-build
else
.DEFAULT_GOAL := $(bench_saved_goal)
endif
