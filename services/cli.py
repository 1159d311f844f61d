"""`buttermilk` command line: one subcommand per job, each module imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.blas import reexec_with_blas
from shared.errors import ButtermilkError

# subcommand → module in services.commands exposing `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "generate": "generate",
    "inspect": "inspect",
    "convert-gguf": "convert",
    "eval-kv": "eval_kv",
    "calibrate-kv": "calibrate_kv",
    "serve": "serve",
    "gateway": "gateway",
    "engine": "engine",
    "controller": "controller",
    "client": "client",
    "pool-size": "pool_size",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (not the usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="buttermilk", description="Local LLM serving on MLX, built around its KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = {}  # name -> its subparser: an unknown flag is reported against its command's help
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"services.commands.{module}")
        parser.commands[name] = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__)
        mod.add_arguments(parser.commands[name])
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; an unknown flag is a one-line error that points at `buttermilk COMMAND --help`
    (argparse leaves unknown flags to the top parser, which would point at `buttermilk --help`). Exits 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point. Exit codes: 0 ok, 1 internal error, 2 user error (message on stderr)."""
    if argv is None:
        reexec_with_blas("services.cli")
    args = parse_args(argv)
    module = importlib.import_module(f"services.commands.{COMMANDS[args.command]}")
    try:
        return module.run(args)
    except ButtermilkError as exc:
        print(f"buttermilk: error: {exc.message}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # invalid option values; unwritable or existing paths
        print(f"buttermilk: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
