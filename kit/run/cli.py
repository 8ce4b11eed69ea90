"""`python -m kit COMMAND ...` (or the `kit` console script): `run` and `presets` (the runner),
`report` and `compare` (the report), `bench compile|decode|suite` (the benchmarks),
`checkpoint` (a random-weight checkpoint folder). Nothing here imports torch: the commands
that measure import what they need when they run."""
from __future__ import annotations

import argparse
import sys

from kit.errors import ConfigError
from kit.run import bench, checkpoint, report, runner

COMMAND_MODULES = [runner, report, bench, checkpoint]


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
