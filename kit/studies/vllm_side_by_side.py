"""Chapter 05: the kit's numbers beside the real vLLM's, for the same config and KV budget.

- KV blocks: the kit's arithmetic (`kit.engine.kv_cache`) against vLLM's own KV cache code
  (`kit.studies.vllm_bridge.vllm_kv_sizing`, no engine) for any model, budget, block size and
  cache dtype; and against a started engine for the chapter's model.
- Decode step time: the kit's decode loop (`kit_decode_steps`, chapter 04's timing) against
  vLLM's engine loop (`kit.studies.vllm_bridge.run_settings`), eager and compiled.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import median

from kit.config import ModelConfig, load, parse_bytes
from kit.engine.decode import blocks_needed, decode_inputs, kv_cache_for, prompt_lengths
from kit.engine.kv_cache import KVCacheSpec, device_label, size_kv_cache
from kit.engine.model import build_model
from kit.errors import ConfigError
from kit.studies.decode_timing import time_strategies
from kit.studies.vllm_bridge import MODES, EngineRun, VLLMKVSizing, run_settings, vllm_kv_sizing


@dataclass
class KVAgreement:
    """One configuration sized by the kit and by vLLM's own code."""

    model: str
    budget_bytes: int
    block_size: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    max_model_len: int
    kit_blocks: int | None
    vllm_blocks: int | None
    kit_log_line: str | None
    vllm_log_line: str | None
    kit_error: str | None
    vllm_error: str | None

    @property
    def agree(self) -> bool:
        """Both refuse, or both give the same blocks and the same log line."""
        if self.kit_error or self.vllm_error:
            return bool(self.kit_error and self.vllm_error)
        return self.kit_blocks == self.vllm_blocks and self.kit_log_line == self.vllm_log_line

    def row(self) -> dict:
        return {**asdict(self), "agree": self.agree}


def kit_kv_sizing(settings, budget_bytes: int):
    """The kit's sizing for `settings` (model, block size, cache dtype, TP, max_model_len) at
    `budget_bytes`; a ConfigError's message when the kit refuses, as vLLM would."""
    try:
        return size_kv_cache(KVCacheSpec.from_settings(settings), budget_bytes,
                             settings.max_model_len, device_label(settings.device))
    except ConfigError as e:
        return str(e)


def kv_agreement(settings, budget_bytes: int) -> KVAgreement:
    """The kit's blocks and log line beside vLLM's for one configuration (no engine)."""
    kit_side = kit_kv_sizing(settings, budget_bytes)
    vllm_side: VLLMKVSizing = vllm_kv_sizing(
        settings.arch, budget_bytes, block_size=settings.block_size,
        max_model_len=settings.max_model_len, kv_cache_dtype=settings.kv_cache_dtype,
        dtype=settings.dtype, tensor_parallel_size=settings.tensor_parallel_size)
    refused = isinstance(kit_side, str)
    return KVAgreement(
        settings.arch.name, budget_bytes, settings.block_size, settings.kv_cache_dtype,
        settings.tensor_parallel_size, settings.max_model_len,
        None if refused else kit_side.num_blocks, vllm_side.num_blocks,
        None if refused else kit_side.log_line(), vllm_side.log_line,
        kit_side if refused else None, vllm_side.error)


def agreement_grid(preset: str, models, budgets, block_sizes, cache_dtypes,
                   tensor_parallel_sizes=(1,), max_model_len: int = 2048) -> list[KVAgreement]:
    """`kv_agreement` for every combination (each model's max_model_len capped at its own)."""
    out = []
    for model, budget, block_size, cache_dtype, tp in itertools.product(
            models, budgets, block_sizes, cache_dtypes, tensor_parallel_sizes):
        arch = ModelConfig.load(model)
        settings = load(preset, model=model, block_size=block_size, kv_cache_dtype=cache_dtype,
                        tensor_parallel_size=tp,
                        max_model_len=min(max_model_len, arch.max_position_embeddings))
        out.append(kv_agreement(settings, parse_bytes(budget)))
    return out


def engine_agreement(settings, budget_bytes: int, run) -> dict:
    """The kit's sizing beside what a started engine (`EngineRun`) decided."""
    kit_side = kit_kv_sizing(settings, budget_bytes)
    ok = not isinstance(kit_side, str) and run.ok
    return {"kit_blocks": kit_side.num_blocks if ok else None, "vllm_blocks": run.num_blocks,
            "kit_log_line": kit_side.log_line() if ok else None,
            "vllm_log_line": run.kv_log_line,
            "kit_cache_bytes": kit_side.cache_bytes if ok else None,
            "vllm_cache_bytes": run.kv_cache_bytes,
            "agree": ok and kit_side.num_blocks == run.num_blocks
            and kit_side.log_line() == run.kv_log_line
            and kit_side.cache_bytes == run.kv_cache_bytes}


# ---------------------------------------------------------------------------------------------
# The kit's decode step: where chapter 04's timing plugs in
# ---------------------------------------------------------------------------------------------

@dataclass
class KitDecode:
    """The kit's decode steps for one mode, in the same shape as vLLM's (`EngineRun`)."""

    mode: str
    strategy: str
    step_seconds: list[float]
    compile_seconds: float | None
    error: str | None = None

    @property
    def median(self) -> float | None:
        return median(self.step_seconds) if self.step_seconds else None


def kit_strategy(mode: str, device: str) -> str:
    """The kit's strategy beside vLLM's mode: eager is eager; compiled is vLLM's way of
    compiling, one guard-free torch.compile, captured in CUDA graphs on a GPU."""
    if mode == "eager":
        return "eager"
    return "cuda_graphs" if device == "cuda" else "guard_free"


def kit_decode_steps(settings, modes=("eager", "compiled"),
                     decode_steps: int = 90) -> dict[str, KitDecode]:
    """Per-step seconds of the kit's paged decode (chapter 04's timing) of
    `settings.batch_size` prompts of `settings.input_len` tokens, `settings.output_len - 1`
    decode steps after the prefill, in a cache of the blocks the run needs, for each mode's
    strategy (`kit_strategy`). After a warm-up (compilation) per strategy, the strategies take
    turns over whole generations until about `decode_steps` steps each are timed, so a noisy
    neighbour slows them alike."""
    strategies = {mode: kit_strategy(mode, settings.device) for mode in modes}
    steps = settings.output_len - 1
    lens = prompt_lengths(settings.batch_size, settings.input_len)
    model = build_model(settings.arch, settings.dtype, settings.device, settings.seed)
    kv_cache = kv_cache_for(settings, blocks_needed(lens, steps, settings.block_size))
    batch, prompts = decode_inputs(settings, kv_cache)
    timings = time_strategies(model, batch, prompts, steps, list(strategies.values()),
                              settings.dtype,
                              num_iters=max(2, -(-decode_steps // max(1, steps))),
                              progress=lambda *_: None, profiled_steps=0)
    out = {}
    for mode, strategy in strategies.items():
        t = timings[strategy]
        error = None if t.correctness is None or t.correctness.ok else \
            f"logits off the no-cache reference by {t.correctness.max_error:.1e}"
        out[mode] = KitDecode(mode, strategy, t.samples.seconds, t.compile_seconds, error)
    return out


# ---------------------------------------------------------------------------------------------
# The chapter's tables
# ---------------------------------------------------------------------------------------------

def kv_rows(kit_sizing, runs: dict) -> list[dict]:
    """KV blocks, tokens, concurrency and bytes: the kit beside each started engine."""
    quantities = [("KV blocks", "num_blocks", "num_blocks"),
                  ("KV tokens (vLLM's 'KV cache size')", "num_tokens", "num_tokens"),
                  ("max concurrency", "max_concurrency", "max_concurrency"),
                  ("KV cache bytes", "cache_bytes", "kv_cache_bytes"),
                  ("block size (tokens)", None, "block_size")]
    rows = []
    for label, kit_attr, run_attr in quantities:
        kit_value = kit_sizing.spec.block_size if kit_attr is None else getattr(kit_sizing, kit_attr)
        row = {"quantity": label, "kit": kit_value}
        row.update({f"vLLM {mode}": getattr(run, run_attr) for mode, run in runs.items()})
        rows.append(row)
    return rows


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


@dataclass
class DecodeComparison:
    """One mode's decode step, the kit beside vLLM (seconds)."""

    mode: str
    kit_strategy: str
    kit_step: float | None
    vllm_step: float | None
    kit_compile: float | None
    vllm_compile: float | None
    vllm_startup: float | None

    @property
    def ratio(self) -> float | None:
        """kit ÷ vLLM: below 1 the kit's step is faster."""
        if self.kit_step is None or not self.vllm_step:
            return None
        return self.kit_step / self.vllm_step

    def ms(self) -> tuple[float | None, float | None]:
        """(kit step, vLLM step) in milliseconds."""
        return _ms(self.kit_step), _ms(self.vllm_step)

    def row(self) -> dict:
        def fmt(v, digits=3):
            return "n/a" if v is None else f"{v:,.{digits}f}"
        return {"mode": self.mode, "kit strategy": self.kit_strategy,
                "kit step (ms)": fmt(_ms(self.kit_step)), "vLLM step (ms)": fmt(_ms(self.vllm_step)),
                "kit ÷ vLLM": fmt(self.ratio, 2), "kit compile (s)": fmt(self.kit_compile, 1),
                "vLLM compile (s)": fmt(self.vllm_compile, 1),
                "vLLM start-up (s)": fmt(self.vllm_startup, 1)}


def decode_comparison(kit_decodes: dict, runs: dict) -> list[DecodeComparison]:
    """Per mode: the kit's median step (`KitDecode`) beside vLLM's (`EngineRun`)."""
    out = []
    for mode, run in runs.items():
        k = kit_decodes.get(mode)
        out.append(DecodeComparison(mode, k.strategy if k else "-", k.median if k else None,
                                    run.decode_step_median, k.compile_seconds if k else None,
                                    run.compile_seconds, run.startup_seconds))
    return out


def best_ratio(comparisons: list[DecodeComparison]) -> float | None:
    """The kit's best step over vLLM's best step (the issue's target: at most 1.0)."""
    kit_steps = [c.kit_step for c in comparisons if c.kit_step is not None]
    vllm_steps = [c.vllm_step for c in comparisons if c.vllm_step is not None]
    if not kit_steps or not vllm_steps:
        return None
    return min(kit_steps) / min(vllm_steps)


def chapter_budget(settings) -> int:
    """The KV budget both sides get: `kv_cache_memory_bytes`, which the CPU needs given."""
    if settings.kv_cache_memory_bytes is None:
        raise ConfigError("chapter 05 compares the kit and vLLM at a fixed KV budget: give "
                          "kv_cache_memory_bytes (e.g. 256MiB); on a GPU vLLM can profile one "
                          "first")
    return settings.kv_cache_memory_bytes


def with_budget(settings, profiled_run):
    """`settings` with vLLM's profiled KV budget (GPU) as `kv_cache_memory_bytes`."""
    if not profiled_run.ok or not profiled_run.kv_cache_bytes:
        raise ConfigError(f"vLLM could not profile a KV budget: {profiled_run.error}; give "
                          "kv_cache_memory_bytes")
    return replace(settings, kv_cache_memory_bytes=profiled_run.memory["kv_cache_budget_bytes"]
                   if profiled_run.memory else profiled_run.kv_cache_bytes)


def run_engines(settings, folder: Path, progress=print) -> dict[str, EngineRun]:
    """vLLM started on the chapter's settings in each mode, one after the other (each shut
    down before the next starts), decode steps timed; each start-up log saved in `folder`."""
    runs = {}
    for mode in MODES:
        progress(f"starting vLLM ({mode}) ...")
        run = runs[mode] = run_settings(settings, mode)
        log = run.save_log(folder)
        progress(f"  {run.error}" if not run.ok else
                 f"  started in {run.startup_seconds:.1f} s (compile "
                 f"{run.compile_seconds or 0:.1f} s), {run.num_blocks:,} blocks of "
                 f"{run.block_size}, median step {run.decode_step_median * 1e3:.3f} ms; "
                 f"log: {log.name}")
    return runs


def grid_per_model(grid: list[KVAgreement]) -> list[dict]:
    """The agreement grid counted per model: cases, agreeing, refused by both."""
    per_model = {}
    for r in grid:
        m = per_model.setdefault(r.model, {"model": r.model, "cases": 0, "agree": 0,
                                           "refused by both": 0})
        m["cases"] += 1
        m["agree"] += r.agree
        m["refused by both"] += bool(r.kit_error and r.vllm_error)
    return list(per_model.values())
