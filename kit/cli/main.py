"""`python -m kit COMMAND ...` (or the `kit` console script): `run` and `presets` (notebooks headless),
`report` and `compare` (the report), `bench compile|decode|suite` (the benchmarks),
`checkpoint` (a random-weight checkpoint folder), `sweep` (a grid of runs, on Ray), `lab`
(JupyterLab on the chapters), `validate` (the prepared GPU validation run), `explain` (a vLLM start-up log's numbers). Nothing
here imports torch or Ray: the commands that need them import them when they run."""
from __future__ import annotations

import argparse
import sys

from kit.errors import ConfigError
from kit.cli import bench, explain, lab, new_checkpoint, validate
from kit.execute import notebooks
from kit.pages import report
from kit.sweep import driver

COMMAND_MODULES = [notebooks, report, bench, new_checkpoint, driver, lab, validate, explain]


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
