"""The benchmarks, `python -m kit bench compile|decode|suite|vllm|experts`: chapter 03's and
chapter 04's measurements without a notebook, printed and written as JSON, the whole suite timed
through `python -m kit run` (kit/cli/suite.py), chapter 05's decode beside vLLM
(kit/cli/bench_vllm.py), and one MoE layer's experts beside vLLM's fused MoE
(kit/cli/bench_experts.py).
Speed targets live here and in those modules, reported, never asserted in tests. The studies
are imported when a benchmark runs, so the other commands start without torch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kit.cli.bench_experts import add_experts_cli
from kit.cli.bench_vllm import add_vllm_cli
from kit.cli.suite import add_suite_cli
from kit.config import DEFAULT_PRESET, load
from kit.execute.notebooks import parse_params
from kit.results import bench_output
from kit.units import fmt_flops


def add_cli(sub) -> None:
    """`python -m kit bench compile`, `... decode` and `... suite`."""
    bench = sub.add_parser("bench", help="benchmarks that print their table (and write JSON)")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    p = benchmarks.add_parser("compile", help="chapter 03's plans (compile strategies), as JSON")
    _common(p)
    p.add_argument("--plans", nargs="*", help="some of chapter 03's plans (default: all)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--no-probe", action="store_true", help="skip the tiny-MLP overhead probe")
    p.set_defaults(func=bench_compile)
    p = benchmarks.add_parser(
        "decode", help="time decode steps per strategy against the bandwidth floor; writes "
        "JSON and prints a table")
    _common(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 is steadier on a busy machine")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file to write (default: runs/bench/decode-<time>-<preset>.json)")
    p.set_defaults(func=bench_decode)
    add_suite_cli(benchmarks, _common)
    add_vllm_cli(benchmarks, _common)
    add_experts_cli(benchmarks, _common)


def _common(p) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET)
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="override a setting, e.g. -p batch_size=8 -p strategies=eager,stock")


def bench_compile(args) -> int:
    """Chapter 03's table as JSON, with the overhead target and the tiny-MLP probe."""
    from kit.engine.kv_cache import KVCacheLayout
    from kit.studies.compile_strategies import compare, overhead_probe, overhead_target
    settings = load(args.preset, **parse_params(args.param))
    out = compare(settings, KVCacheLayout.for_settings(settings), args.plans or None,
                  rounds=args.rounds, calls=args.calls)
    table = out.as_dict()
    table["target"] = overhead_target(out)
    if not args.no_probe:
        table["mlp_probe"] = overhead_probe(settings.device)
    json.dump(table, sys.stdout, indent=1, default=str)
    print()
    return 0


def bench_decode(args) -> int:
    """Chapter 04's measurement: a table, the floor, and the JSON; non-zero when logits left the
    no-cache reference's tolerance."""
    import torch

    from kit.engine.kv_cache import KVCacheLayout
    from kit.show.tables import bandwidth_line, decode_table
    from kit.studies.decode_timing import run_decode, vllm_cpu_reference
    settings = load(args.preset, **parse_params(args.param))
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run_decode(settings, KVCacheLayout.for_settings(settings),
                        progress=lambda m: print(m, flush=True))
    out = args.out or bench_output("decode", args.preset, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.summary(), indent=1, default=str))
    print()
    print(decode_table(report))
    print(floor_line(report))
    print(f"copy bandwidth over the run: {bandwidth_line(report.limits)}; the floor uses the median")
    vllm = vllm_cpu_reference(settings)
    if vllm:
        print(f"vLLM CPU 0.32 on this machine, dtype and shape (recorded, not run here): "
              f"{vllm['step_ms_eager']} ms eager, {vllm['step_ms_compiled']} ms compiled per step")
    elif settings.device == "cpu":
        print("vLLM CPU: no figure recorded for this machine, dtype and shape; chapter 05 runs "
              "it beside the kit (python -m kit run 05 with the same -p)")
    print(f"load average before/after: {report.load_average['before'][0]:.1f} / "
          f"{report.load_average['after'][0]:.1f} (a shared machine: timings are noisy)")
    print(f"wrote {out}")
    failed = report.failed_correctness()
    if failed:
        print(f"error: logits differ from the no-cache reference beyond tolerance: {failed}")
        return 1
    return 0


def floor_line(report) -> str:
    """The bandwidth and compute floors of the median step, written out."""
    cost, limits = report.median_cost, report.limits
    return (f"floor (median step): {cost.total_bytes / 1e6:,.1f} MB / "
            f"{limits.bandwidth / 1e9:,.1f} GB/s = {report.median_floor_seconds * 1e3:.2f} ms; "
            f"compute floor {report.compute_floor_seconds * 1e3:.2f} ms "
            f"({cost.flops / 1e9:,.2f} GFLOP at {fmt_flops(report.compute_rate)})")
