"""`python -m dash_attn <command> [options]`: dispatches to the main(argv) of the module that owns the command."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Callable, Dict, List, Optional, Tuple

# command -> (module whose main(argv) -> int runs it, one-line summary). Modules are imported only when their command
# runs, so `--help` stays fast and one broken command cannot take the others down.
COMMANDS: Dict[str, Tuple[str, str]] = {
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


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid integer value: 'x'"
    return parse


def _head_dim(text: str) -> int:
    from .validation import HEADDIM_MULTIPLE, MAX_HEADDIM  # imports torch: only when the command runs

    value = int(text)
    if value < HEADDIM_MULTIPLE or value % HEADDIM_MULTIPLE or value > MAX_HEADDIM:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEADDIM_MULTIPLE} up to {MAX_HEADDIM} (the head "
                                         f"dims of the kernels), got {value}")
    return value


_head_dim.__name__ = "head dim"


def _check_schedule_args(argv: List[str]) -> Optional[str]:
    """The schedule command's numeric options that its model cannot take (it divides by lengths, heads, batch and
    SMs, and has tiles only for the kernels' head dims), refused as usage errors before dash_attn.schedule runs; its
    own parser reads every option. Returns the error, or None."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for option in ("--seqlen", "--seqlen-k", "--heads", "--heads-k", "--batch", "--num-sms"):
        parser.add_argument(option, type=_int_at_least(1))
    parser.add_argument("--hdim", type=_head_dim)
    parser.add_argument("--block", type=_int_at_least(1), nargs=2)
    parser.add_argument("--window", type=_int_at_least(-1), nargs=2)
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        return str(exc)
    if args.heads is not None and args.heads_k is not None and args.heads % args.heads_k:
        return f"argument --heads-k: must divide --heads ({args.heads}), got {args.heads_k}"
    return None


# command -> check of its arguments run before its module: a message means a usage error (exit status 2).
ARGUMENT_CHECKS: Dict[str, Callable[[List[str]], Optional[str]]] = {"schedule": _check_schedule_args}


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
    problem = ARGUMENT_CHECKS[name](rest) if name in ARGUMENT_CHECKS and "-h" not in rest and "--help" not in rest \
        else None
    if problem is not None:
        sys.stderr.write(f"python -m dash_attn {name}: error: {problem}\n(`python -m dash_attn {name} --help` shows "
                         "the options)\n")
        return 2
    module = importlib.import_module(commands[name][0])
    entry = getattr(module, "main", None)
    if entry is None:
        sys.stderr.write(f"python -m dash_attn: {module.__name__} has no main(argv) for the {name!r} command\n")
        return 2
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
