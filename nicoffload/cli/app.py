"""The ``nicoffload`` command. Each subcommand lives in its own module that exposes
``register(subparsers)``; this file only assembles them and turns expected failures into a
one-line message and a distinct exit code (never a traceback)."""
from __future__ import annotations

import argparse
import importlib
import sys

from nicoffload import __version__
from nicoffload.errors import NicoffloadError, SetupError, VerifierError

#: modules that contribute subcommands, in help order
SUBCOMMAND_MODULES = [
    "nicoffload.cli.agg",
    "nicoffload.cli.ring",
    "nicoffload.cli.testbed",
    "nicoffload.cli.worker",
    "nicoffload.cli.train",
    "nicoffload.cli.bench",
    "nicoffload.cli.doctor",
]


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nicoffload",
        formatter_class=_Formatter,
        description="eBPF/XDP in-network AllReduce: turn a Linux NIC into an AllReduce aggregator.",
        epilog="examples:\n"
        "  sudo nicoffload demo                      # the main job, on a namespace testbed\n"
        "  sudo nicoffload testbed up --workers 4     # N workers + an aggregator in namespaces\n"
        "  sudo nicoffload agg load --netns NS --iface IF --workers 4\n"
        "  sudo nicoffload doctor --iface IF --role aggregator   # a host's preflight (read-only)\n"
        "  nicoffload <command> --help               # every command has examples",
    )
    p.add_argument("--version", action="version", version=f"nicoffload {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and full verifier logs")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMAND_MODULES:
        # a module that fails to import is a broken installation: say so, never drop its commands
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ImportError as e:
        print(f"nicoffload: error: the installation is broken: {e}; run scripts/setup.sh (or pip install -e .) "
              f"again", file=sys.stderr)
        if argv is not None and "--debug" in argv or argv is None and "--debug" in sys.argv:
            raise
        return SetupError.exit_code
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
        return int(rc or 0)
    except NicoffloadError as e:
        print(f"nicoffload: error: {e}", file=sys.stderr)
        if isinstance(e, VerifierError) and args.debug:
            print(e.log, file=sys.stderr)
        if args.debug:
            raise
        return e.exit_code
    except KeyboardInterrupt:
        print("nicoffload: interrupted", file=sys.stderr)
        return 130


def add_examples(parser: argparse.ArgumentParser, *examples: str) -> None:
    """Attach an examples epilog to a subcommand parser (every subcommand has one)."""
    parser.formatter_class = _Formatter
    parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)


if __name__ == "__main__":
    sys.exit(main())
