"""`python -m dash_attn <command> [options]`: dispatches to the main(argv) of the module that owns the command."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Dict, List, Optional, Tuple

# command -> (module whose main(argv) -> int runs it, one-line summary). Modules are imported only when their command
# runs, so `--help` stays fast and one broken command cannot take the others down.
COMMANDS: Dict[str, Tuple[str, str]] = {
    "demo": ("dash_attn.demo",
             "train a tiny GPT twice from one seed and check that losses and weights are bitwise identical"),
    "schedule": ("dash_attn.schedule",
                 "show a backward schedule: visit order, dQ accumulation order, predicted critical path"),
}


def _available() -> Dict[str, Tuple[str, str]]:
    """Commands whose module is present in this installation."""
    found = {}
    for name, (module, summary) in COMMANDS.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except ImportError:
            present = False
        if present:
            found[name] = (module, summary)
    return found


def _usage(commands: Dict[str, Tuple[str, str]]) -> str:
    width = max((len(n) for n in commands), default=0)
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in commands.items())
    return ("usage: python -m dash_attn <command> [options]\n\ncommands:\n" + rows +
            "\n\n`python -m dash_attn <command> --help` shows the options of a command.\n")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _available()
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage(commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        sys.stderr.write(f"python -m dash_attn: unknown command {name!r}\n\n" + _usage(commands))
        return 2
    module = importlib.import_module(commands[name][0])
    entry = getattr(module, "main", None)
    if entry is None:
        sys.stderr.write(f"python -m dash_attn: {module.__name__} has no main(argv) for the {name!r} command\n")
        return 2
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
