"""`python -m kit bench experts`: one MoE layer's decode step alone, each way the kit
multiplies its experts beside vLLM's CPU fused MoE (`kit.studies.expert_layer`): a table of
each way's time, the rate it streams the picked experts' bytes at, and its ratio to the kernel;
writes JSON (default `runs/bench/experts-<time>-<preset>.json`). The model is any with experts,
e.g. `-p model=data/bench/qwen3-30b-a3b-2-layers.json -p dtype=bfloat16 -p batch_size=8`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from kit.config import load
from kit.errors import ConfigError
from kit.execute.notebooks import parse_params
from kit.results import bench_output


def add_experts_cli(benchmarks, common) -> None:
    p = benchmarks.add_parser(
        "experts", help="one MoE layer's decode step, the kit's ways beside vLLM's fused MoE")
    common(p)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file to write (default: runs/bench/experts-<time>-<preset>.json)")
    p.set_defaults(func=bench_experts)


def bench_experts(args) -> int:
    """The table printed and the JSON written; 1 when a way's output left the dtype's
    tolerance of the kernel's."""
    from kit.engine.layers.expert_kernel import library
    from kit.show.tables import Table
    from kit.studies.expert_layer import outside_tolerance, time_expert_layer
    settings = load(args.preset, **parse_params(args.param))
    if settings.device != "cpu":
        raise ConfigError("bench experts times the CPU's ways (the kernel, vLLM's CPU fused "
                          "MoE): run it with a CPU preset")
    if not settings.arch.num_experts:
        raise ConfigError(f"{settings.arch.name} has no experts: give a model with experts, "
                          "e.g. -p model=data/bench/qwen3-30b-a3b-2-layers.json")
    if library() is None:
        raise ConfigError("the expert kernel did not build here (the warning above says why): "
                          "install a C compiler with OpenMP (gcc), or set CC to one")
    load_before = os.getloadavg()
    layer = time_expert_layer(settings.arch, settings.dtype, settings.batch_size,
                              rounds=args.rounds, calls=args.calls)
    out = args.out or bench_output("experts", args.preset, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**asdict(layer), "rows": layer.rows(),
                               "load_average": [load_before, os.getloadavg()]}, indent=1))
    print(f"{layer.model}, {layer.dtype}, batch {layer.batch}: {layer.experts_read} experts "
          f"picked, {layer.bytes_read / 1e6:,.0f} MB to read")
    print(Table(layer.rows(), "One MoE layer's decode step (median of each round's best)"))
    for way, why in layer.skipped.items():
        print(f"{way}: not run ({why})")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          "(a shared machine: timings are noisy)")
    print(f"wrote {out}")
    wrong = outside_tolerance(layer)
    for way in wrong:
        print(f"error: {way}'s output is {layer.error[way]:.1e} from the kernel's")
    return 1 if wrong else 0
