"""The measurements of `python -m kit validate` that no other command makes, each run in a child
process of its own (`python -m kit.cli.validate_steps STEP FOLDER --preset P`), so that a crash,
a hang or an out-of-memory error in one leaves the others' results standing, and the parent
never opens a CUDA context. Each writes `<FOLDER>/<STEP>.json`: what it measured, and `held`,
the claims it checked, each true or false.

- `machine`: the device, the software, the compilers torch.compile needs.
- `probe`: the exact-allocation probe (a tensor of N bytes must measure N bytes), and what the
  process's first matrix product leaves allocated (cuBLAS's workspace, on a GPU: the reason
  every profile warms it up first).
- `profiles`: chapter 01's two profiles, eager and compiled, with their KV cache budgets.
- `profiler_table`: a few decode steps per strategy under torch.profiler, the tables written as
  rows (`kit.measure.profile_rows`, `profile_tables.json`), so that the step breakdown's
  classification can be checked against a recorded table (tests/fixtures holds one).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kit.config import load
from kit.execute.notebooks import parse_params
from kit.units import MiB


def held(claim: str, ok: bool) -> dict:
    return {"claim": claim, "ok": bool(ok)}


def machine(settings) -> dict:
    import torch

    from kit.measure.device import describe, versions
    from kit.studies.setup_check import compilers
    found = compilers(settings.device)  # as Inductor and Triton find theirs (chapter 00's)
    out = {"machine": describe(settings.device), "versions": versions(),
           "compilers": {c.used_by: c.line() for c in found},
           "held": [held(f"the {c.language} compiler {c.used_by} builds with is present",
                         c.found) for c in found]}
    if settings.device == "cuda":
        out["capability"] = list(torch.cuda.get_device_capability())
    gpu = out["machine"]["gpu"]
    out["notes"] = [f"torch {torch.__version__}, CUDA {torch.version.cuda}"
                    + (f", {gpu}, capability {out['capability']}" if gpu else ", no GPU"),
                    *(c.line() for c in found)]
    return out


def first_gemm_bytes(device: str, dtype) -> int:
    """Bytes the process's first matrix product leaves allocated after its result is freed:
    cuBLAS's workspace, which PyTorch takes from its caching allocator and keeps (0 on the
    CPU, where nothing is counted)."""
    import torch
    if device != "cuda":
        return 0
    a = torch.randn(512, 512, device=device, dtype=dtype)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    (a @ a).sum().item()
    torch.nn.functional.linear(a, a, a[0]).sum().item()  # cuBLASLt's addmm path too
    return torch.cuda.memory_allocated() - base


def probe(settings) -> dict:
    from kit.measure.device import torch_dtype
    from kit.measure.memory import probe_measurement
    workspace = first_gemm_bytes(settings.device, torch_dtype(settings.dtype))
    sizes = [MiB, 64 * MiB, 1024 * MiB]
    measured = {n: probe_measurement(settings.device, n) for n in sizes}
    return {"first_gemm_bytes": workspace, "probe": {str(n): m for n, m in measured.items()},
            "notes": [f"the first matrix products left {workspace / MiB:,.1f} MiB allocated "
                      "(cuBLAS's workspace)"] if settings.device == "cuda" else [],
            "held": [held(f"a tensor of {n // MiB:,} MiB measures exactly {n // MiB:,} MiB",
                          measured[n] == n) for n in sizes]}


def profiles(settings) -> dict:
    from kit.engine.profile_run import profile_memory
    found = profile_memory(settings)
    eager, compiled = found["eager"], found["compiled"]
    ratio = compiled.kv_cache_bytes / eager.kv_cache_bytes if eager.kv_cache_bytes > 0 else None
    claims = [held("both profiles leave memory for the KV cache",
                   min(eager.kv_cache_bytes, compiled.kv_cache_bytes) > 0),
              held("the compiled profile's peak is at most the eager one's",
                   compiled.peak_activation_bytes <= eager.peak_activation_bytes)]
    if settings.device == "cuda":
        claims.append(held("non-torch memory is measured", eager.non_torch_bytes is not None))
    notes = [f"{k}: peak activations {p.peak_activation_bytes / MiB:,.1f} MiB, KV cache "
             f"{p.kv_cache_bytes / MiB:,.1f} MiB, non-torch {(p.non_torch_bytes or 0) / MiB:,.1f}"
             f" MiB" for k, p in found.items()]
    if ratio:
        notes.append(f"KV cache compiled ÷ eager: {ratio:.3f}×")
    return {"profiles": {k: p.summary() for k, p in found.items()},
            "kv_cache_ratio_compiled_over_eager": ratio, "held": claims, "notes": notes}


def profiler_table(settings, folder: Path, steps: int = 3) -> dict:
    """`steps` decode steps of each strategy (eager, guard-free, CUDA graphs where there is a
    GPU) under torch.profiler: the tables written to `profile_tables.json` as the step
    breakdown's test fixture reads them (`kit.measure.profile_rows`), and each one's split."""
    import torch

    from kit.engine.decode import decode_inputs, peak_blocks, prompt_lengths
    from kit.engine.decode_fit import check_request
    from kit.engine.decode_runners import warm_up
    from kit.engine.kv_cache import KVCacheLayout, allocate
    from kit.engine.model import build_model
    from kit.engine.runners import CompiledGraphs
    from kit.measure.device import synchronize
    from kit.measure.profile_rows import rows_from_profile, save_profile_tables
    from kit.measure.profiler import profiled
    from kit.measure.step_breakdown import split_rows
    layout = KVCacheLayout.for_settings(settings)
    check_request(settings, layout)
    model = build_model(settings.arch, settings.dtype, settings.device, settings.seed)
    lengths = prompt_lengths(settings.batch_size, settings.input_len)
    cache = allocate(layout, peak_blocks(layout, lengths, 2 + steps), settings.device)
    batch, prompts = decode_inputs(settings, layout, cache)
    strategies = ["eager", "guard_free"] + (["cuda_graphs"] if settings.device == "cuda" else [])
    tables, graphs = {}, CompiledGraphs()  # CUDA graphs capture guard-free's compiled step
    with torch.no_grad():
        for name in strategies:
            runner, _ = warm_up(model, batch, prompts, 2 + steps, name, shared=graphs)
            with profiled(settings.device) as prof:
                for _ in range(steps):
                    batch.step(runner)
                synchronize(settings.device)
            tables[name] = rows_from_profile(prof)
            runner.discard()
    about = {"device": settings.device, "torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name() if settings.device == "cuda" else None,
             "model": settings.arch.name, "dtype": settings.dtype,
             "batch_size": settings.batch_size, "input_len": settings.input_len, "steps": steps}
    save_profile_tables(folder / "profile_tables.json", tables, about)
    split = {name: split_rows(rows, settings.device) for name, rows in tables.items()}
    kinds = "device kernels" if settings.device == "cuda" else "ops"
    return {"split_seconds": split, "held": [
        held(f"{name}: the profiler saw the step's {kinds}",
             any(r.on_device for r in rows) if settings.device == "cuda" else bool(rows))
        for name, rows in tables.items()] + [
        held(f"{name}: weight matmuls found", split[name][0] > 0) for name in tables],
        "notes": [f"{name}: weight matmuls {g / steps * 1e3:.3f} ms, sampling "
                  f"{s / steps * 1e3:.3f} ms per step" for name, (g, s) in split.items()]}


STEPS = {"machine": machine, "probe": probe, "profiles": profiles,
         "profiler_table": profiler_table}


def run_step_cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kit.cli.validate_steps")
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("folder", type=Path)
    p.add_argument("--preset", default="gpu")
    p.add_argument("-p", "--param", action="append", default=[])
    args = p.parse_args(argv)
    settings = load(args.preset, **parse_params(args.param))
    step = STEPS[args.step]
    result = step(settings, args.folder) if step is profiler_table else step(settings)
    (args.folder / f"{args.step}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if all(h["ok"] for h in result["held"]) else 1


if __name__ == "__main__":
    sys.exit(run_step_cli())
