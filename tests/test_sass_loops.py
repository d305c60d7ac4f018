"""CPU tests of csrc/tools/sass_loops.py on a synthetic cuobjdump listing."""
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "tools" / "sass_loops.py"
sys.path.insert(0, str(TOOL.parent))

import sass_loops  # noqa: E402

LISTING = """
        Function : _Z5otherv
        /*0000*/                   HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0 ;     /* 0x0 */
        /*0010*/                   MUFU.EX2 R1, R1 ;                                /* 0x0 */
        /*0020*/                   BRA 0x0 ;                                        /* 0x0 */
        Function : _Z6kernelv
        /*0000*/                   MOV R1, R2 ;                                     /* 0x0 */
        /*0010*/                   HGMMA.64x176x16.F32.BF16 R8, gdesc[UR8], R8 ;    /* 0x0 */
        /*0020*/                   @!P0 BRA 0x50 ;                                  /* 0x0 */
        /*0030*/                   FSEL R3, R3, -INF , !P1 ;                        /* 0x0 */
        /*0040*/                   FSEL R4, R4, -INF , !P1 ;                        /* 0x0 */
        /*0050*/                   MUFU.EX2 R5, R5 ;                                /* 0x0 */
        /*0060*/                   @P0 BRA 0x10 ;                                   /* 0x0 */
        /*0070*/                   @!P2 BRA 0x0 ;                                   /* 0x0 */
"""


def test_the_smallest_step_loop_of_the_named_function():
    code = sass_loops.parse(LISTING, "kernel")
    assert [a for a, _ in code] == list(range(0, 0x80, 0x10))
    loops = sass_loops.step_loops(code)
    count, lo, hi, ops = loops[0]
    assert (count, lo, hi) == (6, 0x10, 0x60) and ops["FSEL"] == 2 and ops["HGMMA.64x176x16.F32.BF16"] == 1
    assert [loop[:3] for loop in loops[1:]] == [(8, 0x0, 0x70)]
    # The masked block the step branches over, left out.
    count, _, _, ops = sass_loops.step_loops(code, skip=[(0x30, 0x50)])[0]
    assert count == 4 and "FSEL" not in ops


def test_command_line(tmp_path):
    listing = tmp_path / "k.sass"
    listing.write_text(LISTING)
    run = subprocess.run([sys.executable, str(TOOL), str(listing), "--function", "kernel", "--loops", "1",
                          "--skip", "0x30-0x50"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("loop 0x10-0x60: 4 instructions"), run.stdout + run.stderr
    missing = subprocess.run([sys.executable, str(TOOL), str(listing), "--function", "nope"], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "no instructions" in missing.stderr


def test_order_of_a_step():
    listing = """
        Function : _Z6kernelv
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], RZ, !UPT ;         /* 0x0 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], R88, gsb0 ;        /* 0x0 */
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, R180, gdesc[UR16].tnspB, R24 ;  /* 0x0 */
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                               /* 0x0 */
        /*0040*/                   FMNMX.FTZ R1, R2, R1, !PT ;                                   /* 0x0 */
        /*0050*/                   MUFU.EX2 R3, R3 ;                                             /* 0x0 */
        /*0060*/                   MUFU.EX2 R4, R4 ;                                             /* 0x0 */
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                               /* 0x0 */
        /*0080*/                   F2FP.BF16.F32.PACK_AB R180, R4, R3 ;                          /* 0x0 */
        /*0090*/                   @P0 BRA 0x0 ;                                                 /* 0x0 */
"""
    code = sass_loops.parse(listing, "kernel")
    assert sass_loops.order(code, 0x0, 0x90) == (
        "HGMMA.ssx2 HGMMA.rs WAIT<=1 MUFU.EX2x2 WAIT<=0 F2FP.BF16.F32.PACK_AB BRA")
