"""`python -m kit COMMAND ...` (or the `kit` console script): each command lives with its
concept and registers itself here."""
from __future__ import annotations

import argparse
import sys

from kit import bench, runner
from kit.config import ConfigError

COMMAND_MODULES = [runner, bench]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kit",
                                     description="Run and measure the study kit's chapters.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_cli(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
