"""`batchspec <command>`: each command lives in batchspec/commands/<name>.py with
`add_arguments(parser)` and `run(args) -> int`. User errors print one line, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from .config import BatchspecError

COMMANDS = {
    "generate": "Decode prompts (speculatively or plainly) and write JSONL outputs.",
    "bench": "Run methods side by side on SpecBench prompts and print speed and exactness.",
    "audit": "Audit any run's outputs against plain greedy decoding; classify divergences.",
    "verify-distribution": "Chi-square test: speculative sampling vs plain sampling.",
    "prepare": "Join, verify and convert the bundled model pair once (run by `make setup`).",
}


def _module(name: str):
    return importlib.import_module(f"batchspec.commands.{name.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # import only the command being run (torch imports are slow)
            _module(name).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(_module(args.command).run(args) or 0)
    except BatchspecError as err:
        print(f"batchspec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
