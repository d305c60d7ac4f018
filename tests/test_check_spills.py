"""CPU tests of csrc/tools/check_spills.py: zero tolerance by default, measured allowances per kernel."""
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "tools" / "check_spills.py"
BWD128 = "_ZN4dash3bwd15bwd_main_kernelINS0_9BwdTraitsILi128EN7cutlass10bfloat16_tELNS_8MaskKindE{}EEEEEvNS0_15BwdKernelParamsIT_EE"
BWD64 = "_ZN4dash3bwd15bwd_main_kernelINS0_9BwdTraitsILi64EN7cutlass6half_tELNS_8MaskKindE{}EEEEEvNS0_15BwdKernelParamsIT_EE"
FWD = "_ZN4dash3fwd15fwd_main_kernelINS0_9FwdTraitsILi128EN7cutlass10bfloat16_tELNS_8MaskKindE0EEEEEvNS0_15FwdKernelParamsIT_EE"


def run(kernel, stack, stores, loads):
    report = (f"ptxas info    : Function properties for {kernel}\n"
              f"    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n")
    return subprocess.run([sys.executable, str(TOOL)], input=report, capture_output=True, text=True)


def test_clean_kernel_passes():
    assert run(FWD, 0, 0, 0).returncode == 0


def test_any_spill_fails_without_an_allowance():
    assert run(FWD, 0, 4, 4).returncode == 1
    assert run(FWD, 8, 0, 0).returncode == 1


def test_allowances_pass_up_to_their_budget_and_fail_above():
    # hdim 64 causal carries 76 bytes (loop invariants of its two step bodies, stored before the loop); hdim 128
    # window 60.
    assert run(BWD64.format(1), 64, 64, 76).returncode == 0
    result = run(BWD64.format(1), 64, 76, 80)
    assert result.returncode == 1 and "allowed: 76" in result.stdout
    assert run(BWD128.format(2), 40, 60, 60).returncode == 0
    assert run(BWD128.format(2), 40, 64, 64).returncode == 1
    # hdim 64 full carries 128 bytes, since its statistics go through the tensor cores; hdim 128 full 44, all in the
    # producer's loop over shift's split tail.
    assert run(BWD64.format(0), 88, 104, 128).returncode == 0
    assert run(BWD64.format(0), 88, 104, 132).returncode == 1
    assert run(BWD128.format(0), 16, 28, 44).returncode == 0
    assert run(BWD128.format(0), 16, 28, 48).returncode == 1


def test_serialized_wgmmas_fail_even_without_spills():
    note = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            f"insufficient register resources for the function '{BWD64.format(0)}'\n")
    result = subprocess.run([sys.executable, str(TOOL)], input=note, capture_output=True, text=True)
    assert result.returncode == 1 and "WGMMAs serialized (C7512)" in result.stdout


def test_spill_free_kernels_have_no_allowance():
    # hdim 128 causal has been spill-free since 9a2f1e0 (again since its kernels carry no split-tail code).
    assert run(BWD128.format(1), 0, 0, 0).returncode == 0
    assert run(BWD128.format(1), 8, 4, 8).returncode == 1
