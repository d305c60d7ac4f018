"""The kernels' build configuration, in one place: the nvcc flags, the defines of a build subset (DASH_ENABLE_* and
the schedule fingerprint), where the CUTLASS headers are, and the check that prebuilt kernel objects can be linked
together. The instantiation axes and file names are csrc/instantiations/generate.py's.

setup.py imports this file; the Makefile and csrc/bench/bench.mk run it (standard library only, imports nothing of
the package, never imports cutlass_library):

  python3 csrc/build_config.py --nvcc-flags          # the flags every kernel TU is compiled with
  python3 csrc/build_config.py --cutlass-include     # CUTLASS's include folder; exit status 1 and the reason on
                                                     # stderr where there is none
  python3 csrc/build_config.py --defines [--hdims 64 128] [--dtypes bf16] [--softcap] [--packed]
"""
import argparse
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def _load_axes():
    spec = importlib.util.spec_from_file_location("dash_attn_instantiations", HERE / "instantiations" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The axis table (HDIMS, DTYPES, MASKS, ..., instantiation_files()).
axes = _load_axes()

# Every kernel TU, wherever it is compiled (setup.py, make check-kernels / prebuild, bench.mk).
# CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED: CuTe's WGMMA selectors take every N the instruction has (multiples of 8), so
# that every GEMM is one WGMMA wide (csrc/common/wgmma.h, asserted by the traits). The current tile configs compile
# to the same code either way; a config with another N needs it.
NVCC_FLAGS = [
    "-std=c++17", "-O3", "--use_fast_math",
    "-gencode", "arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
]
# Added where the TUs are compiled with torch's flags (setup.py): torch disables the half/bf16 operator overloads that
# CUTLASS's numeric types rely on.
TORCH_NVCC_FLAGS = [
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]


def enable_defines(hdims, dtypes, softcap=False, packed=False):
    """The -D flags that tell the dispatchers and the binding which kernels this build has (in the given order)."""
    return ([f"-DDASH_ENABLE_HDIM_{h}" for h in hdims] + [f"-DDASH_ENABLE_{d.upper()}" for d in dtypes]
            + (["-DDASH_ENABLE_SOFTCAP"] if softcap else []) + (["-DDASH_ENABLE_PACKED"] if packed else []))


# The schedule's host functions are inline and shared by name between the kernel objects of one link (nvcc emits
# resolve_schedule as a weak symbol, and the linker keeps one copy for all of them): objects compiled from different
# schedule headers would launch one object's kernel with another object's host-side resolution, and the kernel then
# waits for adds that never come. So every object that compiles the schedule code carries a fingerprint of
# csrc/schedule/ in a local symbol (csrc/schedule/fingerprint.h), and a link takes prebuilt objects of one fingerprint
# only (check_prebuilt).
SCHEDULE_DIR = HERE / "schedule"
FINGERPRINT_SYMBOL = "dash_schedule_fingerprint_"  # followed by FINGERPRINT_DIGITS hex digits
FINGERPRINT_DIGITS = 12


def schedule_fingerprint(directory=SCHEDULE_DIR):
    """FINGERPRINT_DIGITS hex digits of a hash over the schedule headers' names and contents."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(directory).glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:FINGERPRINT_DIGITS]


def build_defines(hdims, dtypes, softcap=False, packed=False):
    """Every -D flag of a kernel TU of this build subset: enable_defines() and the schedule fingerprint."""
    return (enable_defines(hdims, dtypes, softcap, packed)
            + [f"-DDASH_SCHEDULE_FINGERPRINT_SYMBOL={FINGERPRINT_SYMBOL}{schedule_fingerprint()}"])


# The schedule function nvcc emits out of line and shared by name (weak): an object that defines it compiles the
# schedule code on the host.
SHARED_SCHEDULE_SYMBOL = "resolve_schedule"
UNMARKED = "unmarked"


def object_fingerprints(objects):
    """{object: the schedule fingerprint it carries; UNMARKED where it has the shared schedule code but no mark (built
    before the mark existed); None where it has neither (no schedule code)}, read with `nm`. Without `nm`, None for
    every object."""
    nm = shutil.which("nm")
    pattern = re.compile(rf"{FINGERPRINT_SYMBOL}([0-9a-f]{{{FINGERPRINT_DIGITS}}})")
    found = {}
    for obj in objects:
        out = subprocess.run([nm, str(obj)], capture_output=True, text=True).stdout if nm else ""
        match = pattern.search(out)
        found[str(obj)] = match.group(1) if match else (UNMARKED if SHARED_SCHEDULE_SYMBOL in out else None)
    return found


def check_prebuilt(objects):
    """Raises ValueError where prebuilt kernel objects with schedule code do not all carry one fingerprint (compiled
    from different csrc/schedule/ headers, or before the mark: see FINGERPRINT_SYMBOL); returns that fingerprint (None
    where no object has schedule code)."""
    groups = {}
    for obj, fingerprint in object_fingerprints(objects).items():
        if fingerprint is not None:
            groups.setdefault(fingerprint, []).append(pathlib.Path(obj).name)
    if len(groups) > 1 or UNMARKED in groups:
        listing = "; ".join(f"{fp}: {', '.join(sorted(names)[:4])}{' ...' if len(names) > 4 else ''}"
                            for fp, names in sorted(groups.items()))
        raise ValueError("prebuilt kernel objects must all be compiled from one version of csrc/schedule/ (their "
                         "host-side schedule code is shared by name in the link); rebuild them as one set (`make "
                         f"prebuild`). Fingerprints: {listing}")
    return next(iter(groups), None)


class CutlassNotFound(Exception):
    pass


def cutlass_include_dir(cutlass_dir=None):
    """CUTLASS's include folder (the one holding cute/ and cutlass/).

    `cutlass_dir` (default: $CUTLASS_DIR): a CUTLASS checkout or install, or its include/ folder. Unset or empty: the
    nvidia-cutlass wheel's cutlass_library/source/include, located with importlib.util.find_spec without importing
    the package (its own dependencies are not needed for headers). Raises CutlassNotFound with the reason.
    """
    if cutlass_dir is None:
        cutlass_dir = os.environ.get("CUTLASS_DIR", "")
    if cutlass_dir:
        for inc in (pathlib.Path(cutlass_dir) / "include", pathlib.Path(cutlass_dir)):
            if (inc / "cute").is_dir():
                return str(inc)
        raise CutlassNotFound(f"CUTLASS_DIR={cutlass_dir}: {cutlass_dir}/include/cute not found; point CUTLASS_DIR at "
                              "a CUTLASS 4.2 checkout")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        inc = pathlib.Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
        if (inc / "cute").is_dir():
            return str(inc)
    raise CutlassNotFound("CUTLASS headers not found: pip install --no-deps nvidia-cutlass==4.2.0.0 or set CUTLASS_DIR "
                          "(see third_party/README.md)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--nvcc-flags", action="store_true", help="print NVCC_FLAGS")
    what.add_argument("--cutlass-include", action="store_true", help="print CUTLASS's include folder")
    what.add_argument("--defines", action="store_true", help="print the defines of a build subset (build_defines)")
    parser.add_argument("--hdims", nargs="*", default=[], metavar="H")
    parser.add_argument("--dtypes", nargs="*", default=[], metavar="DT")
    parser.add_argument("--softcap", action="store_true", help="the build has the soft-capped kernels")
    parser.add_argument("--packed", action="store_true", help="the build has the packed-sequence kernels")
    args = parser.parse_args(argv)
    if args.nvcc_flags:
        print(" ".join(NVCC_FLAGS))
    elif args.cutlass_include:
        try:
            print(cutlass_include_dir())
        except CutlassNotFound as err:
            print(f"build_config.py: {err}", file=sys.stderr)
            return 1
    else:
        bad = [h for h in args.hdims if not h.isdigit() or int(h) not in axes.HDIMS]
        bad += [d for d in args.dtypes if d not in axes.DTYPES]
        if bad:
            print(f"build_config.py --defines: unsupported value(s) {bad}; head dims {list(axes.HDIMS)}, dtypes "
                  f"{list(axes.DTYPES)}", file=sys.stderr)
            return 2
        print(" ".join(build_defines(args.hdims, args.dtypes, args.softcap, args.packed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
