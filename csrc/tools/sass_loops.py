"""The instruction mix of a kernel's innermost loops, from its SASS (`cuobjdump -sass` output on stdin or in a file).

    cuobjdump -sass build/prebuilt/fwd_hdim128_bf16_full.o | python3 csrc/tools/sass_loops.py --function fwd_kernel
    python3 csrc/tools/sass_loops.py kernel.sass --function bwd_main_kernel --loops 3 --skip 0x41c0-0x49c0

A loop is the span from a backward branch's target to the branch. The smallest loops holding WGMMAs (HGMMA) and exp2
(MUFU.EX2) are the attention mainloops' steps; each is printed with its instruction count and opcode histogram.
--skip leaves out address ranges inside them (the masked blocks a step branches over), so that the count is the one
the steady state executes. docs/profile.md ("Instructions per step") compares ours with FA3's this way.
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


def _range(text):
    lo, hi = (int(part, 16) for part in text.split("-"))
    return lo, hi


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", nargs="?", help="cuobjdump -sass output (default: stdin)")
    parser.add_argument("--function", default=".", help="regex on the kernel's mangled name")
    parser.add_argument("--loops", type=int, default=2, help="how many of the smallest step loops to print")
    parser.add_argument("--skip", type=_range, action="append", default=[], help="0xLO-0xHI to leave out")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
