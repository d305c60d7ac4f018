"""The instruction mix of a kernel's innermost loops, from its SASS (`cuobjdump -sass` output on stdin or in a file).

    cuobjdump -sass build/prebuilt/fwd_hdim128_bf16_full.o | python3 csrc/tools/sass_loops.py --function fwd_kernel
    python3 csrc/tools/sass_loops.py kernel.sass --function bwd_main_kernel --loops 3 --skip 0x41c0-0x49c0

A machine whose CUDA install lacks cuobjdump (nvcc alone, as on a CPU build machine) can take it and the nvdisasm it
calls from the PyPI wheels `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` (both under nvidia/cu13/bin; nvdisasm's
folder goes on PATH).

A loop is the span from a backward branch's target to the branch. The smallest loops holding WGMMAs (HGMMA) and exp2
(MUFU.EX2) are the attention mainloops' steps; each is printed with its instruction count and opcode histogram.
--skip leaves out address ranges inside them (the masked blocks a step branches over), so that the count is the one
the steady state executes. docs/profile.md ("Instructions per step") compares ours with FA3's this way. --order prints
a step's events in program order, runs collapsed (`MUFU.EX2x64`): GEMM issues (`HGMMA.ss`: both operands in shared
memory, `HGMMA.rs`: A from registers), WGMMA waits (`WAIT<=n`: until at most n groups run), barriers, exp2,
conversions and branches; it shows which register math a wait leaves to overlap a running GEMM.
"""
import argparse
import collections
import re
import sys

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def parse(text, function):
    """(address, instruction) of the functions whose name matches the regex `function`, in order."""
    code, inside = [], False
    for line in text.splitlines():
        if "Function :" in line:
            inside = re.search(function, line) is not None
            continue
        match = _INSTRUCTION.match(line) if inside else None
        if match:
            code.append((int(match.group(1), 16), match.group(2)))
    return code


def opcode(instruction):
    return _PREDICATE.sub("", instruction).split()[0]


def loops(code):
    """(start, end) of every backward branch's span."""
    spans = []
    for address, instruction in code:
        if opcode(instruction).startswith("BRA"):
            target = _TARGET.search(instruction.split(None, 1)[-1])
            if target and int(target.group(1), 16) < address:
                spans.append((int(target.group(1), 16), address))
    return spans


def step_loops(code, skip=()):
    """(instructions, start, end, opcode histogram) of the loops holding HGMMA and MUFU.EX2, smallest first; the
    ranges in `skip` (start, end) are left out of the counts."""
    found = []
    for lo, hi in loops(code):
        body = [ins for a, ins in code if lo <= a <= hi and not any(s <= a < e for s, e in skip)]
        ops = collections.Counter(opcode(ins) for ins in body)
        if any(k.startswith("HGMMA") for k in ops) and ops.get("MUFU.EX2"):
            found.append((len(body), lo, hi, ops))
    return sorted(found, key=lambda loop: loop[0])


def _event(instruction):
    """The --order name of an instruction, None for the ones it leaves out."""
    op = opcode(instruction)
    if op.startswith("HGMMA"):
        return "HGMMA.rs" if re.search(r"HGMMA\S*\s+R\d+,\s*R\d+", _PREDICATE.sub("", instruction)) else "HGMMA.ss"
    if op == "WARPGROUP.DEPBAR.LE":
        return "WAIT<=" + str(int(instruction.rsplit(",", 1)[-1].strip(), 0))
    if op.startswith(("BAR.", "SYNCS.", "MUFU.EX2", "F2FP.", "SHFL.")) or op == "BRA":
        return op
    return None


def order(code, lo, hi):
    """The events of [lo, hi] in program order, each run of one event as `NAMExN`."""
    runs = []
    for address, instruction in code:
        event = _event(instruction) if lo <= address <= hi else None
        if event is None:
            continue
        if runs and runs[-1][0] == event:
            runs[-1][1] += 1
        else:
            runs.append([event, 1])
    return " ".join(name if n == 1 else f"{name}x{n}" for name, n in runs)


def _range(text):
    lo, hi = (int(part, 16) for part in text.split("-"))
    return lo, hi


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", nargs="?", help="cuobjdump -sass output (default: stdin)")
    parser.add_argument("--function", default=".", help="regex on the kernel's mangled name")
    parser.add_argument("--loops", type=int, default=2, help="how many of the smallest step loops to print")
    parser.add_argument("--skip", type=_range, action="append", default=[], help="0xLO-0xHI to leave out")
    parser.add_argument("--order", action="store_true", help="also print each loop's events in program order")
    args = parser.parse_args(argv)
    text = open(args.sass).read() if args.sass else sys.stdin.read()
    code = parse(text, args.function)
    if not code:
        parser.error(f"no instructions of a function matching {args.function!r}")
    for count, lo, hi, ops in step_loops(code, args.skip)[:args.loops]:
        print(f"loop {lo:#x}-{hi:#x}: {count} instructions")
        print("  " + ", ".join(f"{name} {n}" for name, n in ops.most_common()))
        branches = [f"{a:#x} {ins}" for a, ins in code if lo <= a <= hi and "BRA" in ins]
        print("  branches: " + "; ".join(branches))
        if args.order:
            print("  order: " + order(code, lo, hi))
    return 0


if __name__ == "__main__":
    sys.exit(main())
