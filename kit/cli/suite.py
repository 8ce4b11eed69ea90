"""`python -m kit bench suite`: the whole suite (or the notebooks named) run headless (`python -m kit run`),
timed per chapter, with whether torch's Inductor cache was cold or warm before the run; prints a
table and writes a JSON (default `runs/bench/suite-<time>-<preset>.json`). The speed targets
below are printed beside the numbers, never asserted.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kit.execute.notebooks import find_notebooks, parse_params, run
from kit.results import bench_output

# The whole suite on cpu-small, on a 2-core CPU without native bf16 (the machines described in
# docs/cpus.md, "The suite per chapter"), with Inductor's cache empty (cold) or filled by an
# earlier run (warm).
TARGETS = {"cpu-small": {"cold_seconds": 300, "warm_seconds": 150,
                         "machine": "2-core CPU without native bf16"}}


def inductor_cache() -> dict:
    """Inductor's cache folder as torch resolves it (`TORCHINDUCTOR_CACHE_DIR`, else
    /tmp/torchinductor_$USER) and whether it held anything: empty or missing is cold."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    path = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    entries = len(list(path.iterdir())) if path.is_dir() else 0
    return {"dir": str(path), "entries_before": entries, "state": "warm" if entries else "cold"}


def suite_result(summary: dict, folder: Path, cache: dict, whole_suite: bool) -> dict:
    """What the JSON holds: seconds, status and checks per chapter, the total, the machine,
    the cache's state, the run folder and, for a preset that has them, the targets."""
    chapters = {nb["notebook"]: {"seconds": nb["seconds"], "ok": nb["ok"],
                                 "checks_passed": nb["checks_passed"],
                                 "checks_failed": nb["checks_failed"]}
                for nb in summary["notebooks"]}
    result = {"preset": summary["preset"], "parameters": summary["parameters"],
              "chapters": chapters, "total_seconds": summary.get("seconds", 0.0),
              "ok": all(c["ok"] for c in chapters.values()), "whole_suite": whole_suite,
              "inductor_cache": cache, "machine": summary["machine"],
              "versions": summary["versions"], "run_folder": str(folder)}
    target = TARGETS.get(summary["preset"]) if not summary["parameters"] else None
    if target:
        limit = target[f"{cache['state']}_seconds"]
        result["target"] = {**target, "within": result["total_seconds"] <= limit
                            if whole_suite else None}
    return result


def suite_table(result: dict) -> str:
    lines = [f"{'chapter':<28} {'status':<6} {'checks':>7} {'seconds':>8}"]
    for name, c in result["chapters"].items():
        n = c["checks_passed"] + len(c["checks_failed"])
        lines.append(f"{name:<28} {'ok' if c['ok'] else 'FAIL':<6} "
                     f"{c['checks_passed']:>3}/{n:<3} {c['seconds']:>8.1f}")
    lines.append(f"{'total':<28} {'':<6} {'':>7} {result['total_seconds']:>8.1f}")
    cache = result["inductor_cache"]
    lines.append(f"Inductor cache before the run: {cache['state']} ({cache['dir']}, "
                 f"{cache['entries_before']} entries)")
    lines.append(f"this CPU: {bf16_line(result['machine'])}")
    return "\n".join(lines + target_lines(result))


def bf16_line(machine: dict) -> str:
    """The CPU's kernels and whether its bf16 matmuls ran natively, as the run measured them
    (the targets are for a CPU without native bf16)."""
    isa = machine.get("cpu_isa") or {}
    measured = machine.get("measured") or {}
    speed = measured.get("speed_vs_float32.bfloat16")
    if speed is None and measured.get("slowdown_vs_float32.bfloat16"):  # a run before the rename
        speed = 1 / measured["slowdown_vs_float32.bfloat16"]
    kernels = f"PyTorch's kernels {isa.get('pytorch_kernels', '?')}"
    if speed is None:
        return f"{kernels}; bf16 matmul speed not measured in this run (chapter 00 measures it)"
    from kit.measure.dtype_speed import SLOW_FACTOR
    state = "emulated" if speed < 1 / SLOW_FACTOR else "native"
    return f"{kernels}; bf16 matmuls {state}, at {speed:,.2f}× float32's FLOP/s"


def target_lines(result: dict) -> list[str]:
    target = result.get("target")
    if not target:
        return []
    line = (f"target ({result['preset']}, whole suite, {target['machine']}): "
            f"{target['cold_seconds']} s with cold compile caches, {target['warm_seconds']} s "
            f"warm; this run: {result['inductor_cache']['state']}, "
            f"{result['total_seconds']:.0f} s")
    if target["within"] is None:
        return [line + " (some notebooks only: not comparable)"]
    return [line + (" (within)" if target["within"] else " (over)")]


def bench_suite(args) -> int:
    """Run the suite, print the table, write the JSON; the exit status is the run's."""
    cache = inductor_cache()
    whole_suite = find_notebooks(args.notebooks) == find_notebooks([])
    t0 = time.perf_counter()
    code, folder = run(args.preset, args.notebooks, parse_params(args.param), out=args.runs,
                       progress=not args.no_progress)
    summary = json.loads((folder / "summary.json").read_text())
    result = suite_result(summary, folder, cache, whole_suite)
    result["command_seconds"] = round(time.perf_counter() - t0, 2)
    out = args.out or bench_output("suite", args.preset, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{suite_table(result)}\nwrote {out}")
    return code


def add_suite_cli(benchmarks, common) -> None:
    """`python -m kit bench suite [NOTEBOOK ...]`."""
    p = benchmarks.add_parser("suite", help="the whole suite run headless: seconds per "
                              "chapter and in total, cold or warm compile cache; writes JSON")
    common(p)
    p.add_argument("notebooks", nargs="*", help="some notebooks only (default: all)")
    p.add_argument("--runs", type=Path, default=None,
                   help="where the run folder goes (default ./runs, as `python -m kit run`)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file to write (default: runs/bench/suite-<time>-<preset>.json)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=bench_suite)
