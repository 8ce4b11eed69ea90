"""`python -m kit COMMAND ...` (or the `kit` console script): each command lives with its
concept and registers itself here."""
from __future__ import annotations

import argparse
import sys

from kit import decode_bench, runner, strategies
from kit.config import ConfigError

COMMAND_MODULES = [runner, strategies, decode_bench]


def bench_commands(sub):
    """The subcommands of `python -m kit bench NAME`: a module adding a benchmark calls this
    from its `add_cli(sub)` and adds its parser here (made once, shared by every module)."""
    if "bench" not in sub.choices:
        bench = sub.add_parser("bench", help="benchmarks that print their table as JSON")
        bench.set_defaults(bench_commands=bench.add_subparsers(dest="benchmark", required=True))
    return sub.choices["bench"].get_default("bench_commands")


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
