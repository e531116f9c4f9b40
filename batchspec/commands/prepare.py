"""`batchspec prepare`: join, verify and convert the bundled model pair once, so later runs load in
seconds (part of `make setup`)."""

from __future__ import annotations

import argparse
import sys

from ..bundled import BUNDLED, bundled_model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--roles", default="draft,target", help="which bundled models to prepare (default: both)")


def run(args: argparse.Namespace) -> int:
    for role in args.roles.split(","):
        path = bundled_model_dir(role.strip())
        print(f"{BUNDLED[role.strip()].name}: ready at {path}", file=sys.stderr)
    return 0
