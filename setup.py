"""Build script for dash_attn.

Always builds the CPU module `dash_attn._sched` (the schedule engine, no torch, no CUDA). Builds the CUDA extension
`dash_attn._C` only when a CUDA build of torch and nvcc are both present; otherwise installs the pure-Python package
(CPU reference path) and says so in one line.

Environment knobs:
  MAX_JOBS                   parallel compile jobs (read by torch's ninja backend)
  NVCC_THREADS               nvcc --threads per job (default 2)
  DASH_ATTN_HDIMS            head dims to compile, e.g. "64,128" (default 64,128,256)
  DASH_ATTN_DTYPES           "fp16,bf16" (default both)
  DASH_ATTN_SOFTCAP          "0" skips the soft-capped kernels (softcap > 0), half the kernel objects (default "1")
  DASH_ATTN_PACKED           "0" skips the packed-sequence (varlen) kernels; varlen calls then run the batched
                             kernels once per run of equal lengths (default "1")
  DASH_ATTN_SKIP_CUDA_BUILD  "1" skips dash_attn._C even where it could be built
  DASH_ATTN_DEBUG_SPIN       "1" turns an over-long semaphore spin into a trap that prints the tile coordinates
  DASH_ATTN_LINEINFO         "1" adds -lineinfo (sanitizer/profiler source lines)
  DASH_ATTN_PREBUILT_DIR     folder of kernel objects from `make prebuild` to link instead of compiling them
  CUTLASS_DIR                CUTLASS checkout/install whose include/ holds cute/ and cutlass/, or that include/
                             folder (else the nvidia-cutlass==4.2.0.0 wheel is located without importing it; see
                             third_party/)

The nvcc flags, the defines (DASH_ENABLE_*, the schedule fingerprint), the CUTLASS lookup and the check of prebuilt
objects are csrc/build_config.py's, the instantiation files csrc/instantiations/generate.py's axis table (shared with
the Makefile and csrc/bench/bench.mk).
"""
import importlib.util
import os
import pathlib
import shutil
import sys

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _load_build_config():
    # By path: csrc/ is no package, and putting it on sys.path would let its folders shadow other modules.
    spec = importlib.util.spec_from_file_location("dash_attn_build_config", CSRC / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_config = _load_build_config()
ALL_HDIMS = build_config.axes.HDIMS
ALL_DTYPES = tuple(build_config.axes.DTYPES)


def _env_list(name, allowed, cast=str):
    raw = os.environ.get(name, "")
    if not raw.strip():
        return list(allowed)
    values = [cast(v.strip()) for v in raw.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad:
        sys.exit(f"{name}={raw!r}: unsupported value(s) {bad}; choose from {list(allowed)}")
    return values


def cutlass_include_dir():
    """CUTLASS headers (build_config.cutlass_include_dir); a CUTLASS_DIR without them stops the build."""
    try:
        return build_config.cutlass_include_dir()
    except build_config.CutlassNotFound as err:
        if os.environ.get("CUTLASS_DIR"):
            sys.exit(str(err))
        raise


def sched_extension():
    from pybind11.setup_helpers import Pybind11Extension

    return Pybind11Extension(
        "dash_attn._sched",
        [str(p.relative_to(ROOT)) for p in sorted((CSRC / "sched_py").glob("*.cpp"))],
        include_dirs=[str(CSRC)],
        cxx_std=17,
        extra_compile_args=["-O2"],
    )


def cuda_build_blocker():
    """Why dash_attn._C cannot be built here, or None when it can."""
    if os.environ.get("DASH_ATTN_SKIP_CUDA_BUILD", "0") == "1":
        return "DASH_ATTN_SKIP_CUDA_BUILD=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "torch is not importable in the build environment (use pip install --no-build-isolation)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return "nvcc was not found (set CUDA_HOME)"
    try:
        cutlass_include_dir()
    except build_config.CutlassNotFound as err:
        return str(err)
    return None


def _split_prebuilt(sources):
    """Kernel objects compiled elsewhere (`make prebuild` on a CPU machine) replace their .cu sources.

    The kernel TUs include no torch header, so they can be compiled on any machine with nvcc; only the binding TU
    needs the target's torch. This keeps GPU-node builds to seconds. Only instantiation TUs are taken: the dispatch
    TUs switch on this build's head dims and dtypes (its defines), so they are compiled here (seconds), never taken
    from a folder built for another set.
    """
    directory = os.environ.get("DASH_ATTN_PREBUILT_DIR")
    if not directory:
        return sources, []
    kept, objects = [], []
    for src in sources:
        obj = pathlib.Path(directory) / (pathlib.Path(src).stem + ".o")
        if src.endswith(".cu") and obj.is_file():
            objects.append(str(obj.resolve()))
        else:
            kept.append(src)
    try:
        fingerprint = build_config.check_prebuilt(objects)
    except ValueError as err:
        raise SystemExit(f"dash_attn: DASH_ATTN_PREBUILT_DIR={directory}: {err}") from None
    print(f"dash_attn: linking {len(objects)} prebuilt kernel objects from {directory}")
    if fingerprint is not None and fingerprint != build_config.schedule_fingerprint():
        print("dash_attn: note: they were compiled from other csrc/schedule/ headers than this tree's (one set, so "
              "they link; dash_attn._sched describes this tree's schedules)")
    return kept, objects


def cuda_extension():
    from torch.utils.cpp_extension import CUDAExtension

    hdims = _env_list("DASH_ATTN_HDIMS", ALL_HDIMS, int)
    dtypes = _env_list("DASH_ATTN_DTYPES", ALL_DTYPES)
    softcap = os.environ.get("DASH_ATTN_SOFTCAP", "1") != "0"
    packed = os.environ.get("DASH_ATTN_PACKED", "1") != "0"
    defines = build_config.build_defines(hdims, dtypes, softcap, packed)
    inst = build_config.axes.instantiation_files("csrc/instantiations/", hdims=hdims, dtypes=dtypes,
                                                 score_mods=["none", "softcap"] if softcap else ["none"],
                                                 layouts=["batched", "packed"] if packed else ["batched"])
    inst, prebuilt = _split_prebuilt(inst)
    sources = ["csrc/api/binding.cpp", "csrc/fwd/fwd_dispatch.cu", "csrc/bwd/bwd_dispatch.cu",
               "csrc/common/seqlens_check.cu", "csrc/common/kv_head_sum.cu"] + inst
    nvcc_flags = (build_config.NVCC_FLAGS + build_config.TORCH_NVCC_FLAGS
                  + ["--threads", os.environ.get("NVCC_THREADS", "2")] + defines)
    if os.environ.get("DASH_ATTN_LINEINFO", "0") == "1":
        nvcc_flags.append("-lineinfo")  # for compute-sanitizer / ncu source views; makes the .so much larger
    if os.environ.get("DASH_ATTN_DEBUG_SPIN", "0") == "1":
        nvcc_flags.append("-DDASH_BWD_SPIN_TRAP")
    return CUDAExtension(
        "dash_attn._C",
        sources,
        extra_objects=prebuilt,
        include_dirs=[str(CSRC), cutlass_include_dir()],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"] + defines, "nvcc": nvcc_flags},
    )


def build():
    ext_modules = [sched_extension()]
    cmdclass = {}
    blocker = cuda_build_blocker()
    if blocker is None:
        from torch.utils.cpp_extension import BuildExtension

        ext_modules.append(cuda_extension())
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
    else:
        print(f"dash_attn: building without CUDA kernels ({blocker}); CUDA tensors will raise a clear error")
    # Name, version, dependencies, extras and license: pyproject.toml's [project].
    setup(
        packages=find_packages(include=["dash_attn", "dash_attn.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


build()
