"""The command line: thin by design.

Each subcommand lives in its own module here with two functions: ``add_parser(sub)``
declares its arguments, ``run(args) -> int`` turns them into an options dataclass, calls
the library, formats the result and returns an exit status. This module only dispatches
and turns every :class:`ggufcheck.errors.GGUFCheckError` into one line and an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

from ggufcheck import __version__, interrupts
from ggufcheck.errors import EXIT_STATUS_TEXT, ExitStatus, GGUFCheckError

START_HERE = ("New here? `ggufcheck demo` shows the whole method on a tiny model (offline); then "
              "`ggufcheck inspect MODEL.gguf` (the file alone) and `ggufcheck diagnose MODEL.gguf --engine SPEC` "
              "(a deployment). Docs: docs/index.md.")

# Subcommand modules, in the order they appear in --help (data-flow order).
COMMANDS = [
    "env",
    "kernels",
    "inspect",
    "reference",
    "shard",
    "compare",
    "quants",
    "diagnose",
    "rejudge",
    "export",
    "demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufcheck",
        description="Find why a deployed GGUF model produces wrong output.",
        epilog="\n\n".join(textwrap.fill(text, 78) for text in (START_HERE, EXIT_STATUS_TEXT)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ggufcheck {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"ggufcheck.cli.{name}").add_parser(sub)
    for command in sub.choices.values():  # one convention for every command
        if not any("--quiet" in a.option_strings for a in command._actions):
            command.add_argument("-q", "--quiet", action="store_true", help="no progress display while running")
    return parser


def status(console, args, text: str):
    """``console.status(text)``, or a silent stand-in under ``--quiet`` (it takes ``update``)."""
    if getattr(args, "quiet", False):
        from types import SimpleNamespace
        from contextlib import nullcontext

        return nullcontext(SimpleNamespace(update=lambda *_a, **_k: None))
    return console.status(text)




def check_report_paths(args) -> None:
    """Every report path (the options in REPORT_OPTIONS) must be writable before any work
    starts: a run of minutes must not end in "cannot write" with its verdict lost."""
    from pathlib import Path

    from ggufcheck.errors import UsageError

    for option in REPORT_OPTIONS:
        value = getattr(args, option, None)
        if value is None or (option == "json" and str(value) == "-"):
            continue
        path = Path(value)
        flag = "--" + option.replace("_", "-")
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory, not a file")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: the directory {parent} does not exist",
                             tip=f"mkdir -p {parent}, or name a file in an existing directory")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise UsageError(f"{flag} {path}: not writable")


REPORT_OPTIONS = ("json", "html")


def main(argv: list[str] | None = None) -> int:
    from ggufcheck.runtime import configure, keep_freed_memory

    configure()  # one thread budget for torch, numba and llama.cpp, before any of them loads
    keep_freed_memory()  # big short-lived tensors reuse warm heap memory
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 on --help
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(f"ggufcheck: no command given. {START_HERE}", file=sys.stderr)
        return int(ExitStatus.USAGE)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # the command line, for the report header
    module = importlib.import_module(f"ggufcheck.cli.{args.command}")
    json_to_stdout = str(getattr(args, "json", None)) == "-"
    real_stdout = sys.stdout
    try:
        check_report_paths(args)
        if json_to_stdout:  # --json -: the JSON alone on stdout, everything else on stderr
            from ggufcheck.report import json as report_json

            report_json.STDOUT, sys.stdout = real_stdout, sys.stderr
        with interrupts.handled():  # SIGTERM / SIGHUP unwind like Ctrl-C: engines and workers closed
            return int(module.run(args))
    except GGUFCheckError as err:
        print(f"ggufcheck {args.command}: error: {err.message}", file=sys.stderr)
        if err.tip:
            print(f"tip: {err.tip}", file=sys.stderr)
        return int(err.exit_status)
    except KeyboardInterrupt as err:
        how = "interrupted" if interrupts.name(err) == "SIGINT" else f"terminated ({interrupts.name(err)})"
        print(f"ggufcheck: {how}; engines closed", file=sys.stderr)
        return interrupts.exit_status(err)
    except Exception as err:  # a defect in ggufcheck: one line, the traceback only on request
        if os.environ.get("GGUFCHECK_DEBUG"):
            raise
        print(f"ggufcheck {args.command}: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        print("tip: this is a ggufcheck bug; rerun with GGUFCHECK_DEBUG=1 for the traceback and report it",
              file=sys.stderr)
        return int(ExitStatus.INTERNAL)
    finally:
        if json_to_stdout:
            from ggufcheck.report import json as report_json

            sys.stdout, report_json.STDOUT = real_stdout, None
