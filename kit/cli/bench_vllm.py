"""`python -m kit bench vllm`: chapter 05's decode comparison without the notebook. The kit's
decode (eager and its compiled strategy) and vLLM's engine (eager and compiled, or the modes
`--modes` names) on the same model, dtype, batch, prompts' length and KV budget, in one
process, taking turns generation by generation (`side_by_side`): each decode step's median and
the same requests end to end (prefill and every step), the ratios kit ÷ vLLM per mode and best
against best; prints the tables and writes a folder (default
`runs/bench/vllm-<time>-<preset>/`): `result.json` and vLLM's start-up logs. The target
(best ÷ best at most 1.0) is printed, never asserted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kit.config import load
from kit.errors import ConfigError
from kit.execute.notebooks import parse_params
from kit.results import bench_output

# What chapter 05's parameters default to where the preset's values do not suit vLLM's CPU
# backend: a block size that is a multiple of 32 (its CPU default) and a fixed KV budget.
DEFAULTS = {"block_size": 128, "kv_cache_memory_bytes": "256MiB"}


def add_vllm_cli(benchmarks, common) -> None:
    p = benchmarks.add_parser(
        "vllm", help="the kit's decode beside vLLM's engine, per step and end to end; writes "
        "JSON and prints a table")
    common(p)
    p.add_argument("--out", type=Path, default=None,
                   help="folder to write (default: runs/bench/vllm-<time>-<preset>/)")
    p.add_argument("--modes", default=None, metavar="MODE[,MODE]",
                   help="which of vLLM's modes, each beside the kit's match (default "
                   "eager,compiled; compiled alone skips the eager pair, the slow one on "
                   "a large model)")
    p.set_defaults(func=bench_vllm)


def print_dense_choices(choices) -> None:
    """Which way each large float32 dense product ran, as measured in this run
    (`kit.engine.layers.product_choice`)."""
    for c in choices:
        print(f"dense product {c.out_features} x {c.in_features} at {c.rows} rows: "
              f"{c.summary()['runs_in']} (kernel ÷ oneDNN {c.ratio:.2f}, measured here)")


def parse_modes(text: str | None) -> tuple[str, ...]:
    """`--modes compiled` -> ("compiled",), None -> both; refuses an unknown or repeated mode."""
    from kit.vllm.engine_runs import MODES
    if text is None:
        return MODES
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown or len(set(modes)) < len(modes):
        raise ConfigError(f"--modes {text}: give one or both of {', '.join(MODES)}, "
                          "comma-separated, each once")
    return modes


def kit_strategy_of(settings) -> str | None:
    """`-p strategies=NAME` (checked with the settings): the kit's strategy beside every mode,
    e.g. guard_free, its best, beside each of vLLM's modes in the same minutes; None (the
    default): eager beside eager, compiled beside compiled. More than one is refused."""
    if settings.strategies and len(settings.strategies) > 1:
        raise ConfigError(f"strategies={','.join(settings.strategies)}: bench vllm runs one "
                          "kit strategy beside every mode; give one, e.g. -p strategies=guard_free")
    return settings.strategies[0] if settings.strategies else None


def settings_for(preset: str, params: list[str]):
    """The preset with chapter 05's defaults (DEFAULTS) under the -p overrides."""
    return load(preset, **{**DEFAULTS, **parse_params(params)})


def bench_vllm(args) -> int:
    """Both sides timed, the table printed, the JSON written; 1 when a side failed (vLLM did
    not start, or the kit's logits left the no-cache reference's tolerance)."""
    from kit.engine.kv_cache import KVCacheLayout
    from kit.engine.layers.product_choice import measured_choices
    from kit.measure.device import describe, versions
    from kit.show.tables import Table
    from kit.studies import vllm_side_by_side
    from kit.vllm.installed import vllm_missing, vllm_version
    settings = settings_for(args.preset, args.param)
    modes = parse_modes(args.modes)
    strategy = kit_strategy_of(settings)
    vllm_side_by_side.chapter_budget(settings)
    missing = vllm_missing()
    if missing:
        raise ConfigError(missing)
    folder = args.out or bench_output("vllm", args.preset)
    folder.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"kit: {settings.arch.name} {settings.dtype}, batch {settings.batch_size}, "
          f"{settings.input_len} prompt tokens, {settings.output_len} generated", flush=True)
    kit, runs = vllm_side_by_side.side_by_side(settings, KVCacheLayout.for_settings(settings),
                                               folder, progress=lambda m: print(m, flush=True),
                                               modes=modes, strategy=strategy)
    started = {m: r for m, r in runs.items() if r.ok}
    comparisons = vllm_side_by_side.decode_comparison(kit, started)
    result = {"preset": args.preset, "parameters": parse_params(args.param), "modes": modes,
              "settings": settings.as_dict(),
              "machine": describe(settings.device),
              "versions": versions(), "vllm_version": vllm_version(),
              "decode": [c.row() for c in comparisons],
              "end_to_end": [c.end_to_end_row() for c in comparisons],
              "best_step_ratio": vllm_side_by_side.best_ratio(comparisons),
              "best_end_to_end_ratio": vllm_side_by_side.best_ratio(comparisons, end_to_end=True),
              "kit": {m: {"strategy": k.strategy, "error": k.error, "step_seconds": k.step_seconds,
                          "compile_seconds": k.compile_seconds,
                          "prefill_compile_seconds": k.prefill_compile_seconds,
                          "prefills": k.prefills,
                          "generations": k.generations, "prefill_seconds": k.prefill_seconds,
                          "end_to_end_seconds": k.end_to_end_seconds} for m, k in kit.items()},
              "vllm": {m: r.summary() for m, r in runs.items()},
              "dense_products": [c.summary() for c in measured_choices()],
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    (folder / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print()
    print(Table(result["decode"], "Decode step (median)"))
    print(Table(result["end_to_end"], "The same requests end to end (median generation)"))
    for label, key in (("decode step", "best_step_ratio"), ("end to end", "best_end_to_end_ratio")):
        ratio = result[key]
        print(f"kit's best ÷ vLLM's best, {label}: " + ("n/a" if ratio is None else
              f"{ratio:.2f} (target: at most 1.00)"))
    print_dense_choices(measured_choices())
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          "(a shared machine: timings are noisy)")
    print(f"wrote {folder}")
    failed = [f"vLLM {m}: {r.error}" for m, r in runs.items() if not r.ok] + \
        [f"kit {m}: {k.error}" for m, k in kit.items() if k.error]
    for line in failed:
        print(f"error: {line}")
    return 1 if failed else 0
