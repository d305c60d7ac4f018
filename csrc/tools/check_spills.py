"""Fails when ptxas reports register spills or a stack frame in a kernel (reads `nvcc -Xptxas -v` output on stdin).

Spills in these kernels cost far more than they look: they turn register tiles into local-memory traffic inside the
WGMMA loop. The report is echoed so the register counts stay visible in the log.
"""
import re
import sys

SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
STACK = re.compile(r"(\d+) bytes stack frame")


def main():
    bad = []
    current = "?"
    for line in sys.stdin:
        sys.stdout.write(line)
        if "Compiling entry function" in line or "Function properties for" in line:
            current = line.strip().split()[-1]
        m = SPILL.search(line)
        if m and (int(m.group(1)) or int(m.group(2))):
            bad.append(f"{current}: {m.group(0)}")
        s = STACK.search(line)
        if s and int(s.group(1)) and "Function properties" not in line:
            bad.append(f"{current}: {s.group(0)}")
    if bad:
        print("\ncheck-kernels: register spills / stack frames found:", *bad, sep="\n  ")
        return 1
    print("\ncheck-kernels: no spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
