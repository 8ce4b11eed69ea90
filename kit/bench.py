"""`python -m kit bench NAME ...`: benchmarks that write a JSON and print a short table, for
comparing machines and strategies. Each benchmark module defines `add_bench(bench_sub)` and is
listed in `BENCH_MODULES`."""
from __future__ import annotations

from kit import decode_bench

BENCH_MODULES = [decode_bench]


def add_cli(sub) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (decode: per-step latency per "
                            "strategy against the bandwidth floor)")
    bench_sub = parser.add_subparsers(dest="bench", required=True)
    for module in BENCH_MODULES:
        module.add_bench(bench_sub)
