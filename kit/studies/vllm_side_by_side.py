"""Chapter 05: the kit's numbers beside the real vLLM's, for the same config and KV budget.

- KV blocks: the kit's KV cache config (`kit.engine.kv_cache`) against vLLM's own KV cache code
  (`kit.vllm.kv_sizing.vllm_kv_sizing`, no engine) for any model, budget, block size and
  cache dtype; and against a started engine for the chapter's model.
- Decode step time and end to end: the kit's decode loop (`KitTurns`, chapter 04's paged
  decode) against vLLM's engine loop (`kit.vllm.engine_runs.run_settings`), eager and
  compiled, taking turns generation by generation (`side_by_side`).
"""
from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kit.config import ModelConfig, load
from kit.engine.checkpoint import write_checkpoint
from kit.engine.decode import decode_inputs, generate, peak_blocks, prompt_lengths
from kit.engine.kv_cache import KVCacheConfig, KVCacheLayout, allocate, config_for_settings
from kit.engine.model import build_model
from kit.engine.routing_replay import check_routed_against_no_cache
from kit.errors import ConfigError
from kit.engine.decode_runners import SharedPrefill, warm_up
from kit.measure.timing import median_or_none
from kit.vllm.concurrency import concurrency_curve
from kit.vllm.engine_runs import DECODE_STEPS, MODES, EngineRun, run_settings
from kit.vllm.installed import vllm_missing
from kit.vllm.kv_sizing import VLLMKVSizing, VLLMSizer, vllm_kv_sizing
from kit.vllm.greedy import same_tokens
from kit.vllm.model_folder import safe_name, weights_folder, write_model_folder
from kit.units import Bytes, Count, Ratio, Seconds, parse_bytes, typed


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
        return {**typed(asdict(self), {Bytes: ("budget_bytes",),
                                       Count: ("block_size", "max_model_len", "kit_blocks",
                                               "vllm_blocks", "tensor_parallel_size")}),
                "agree": self.agree}


def kit_kv_config(layout: KVCacheLayout, settings, budget_bytes: int) -> KVCacheConfig | str:
    """The kit's KV cache config for `settings` (max_model_len, device, batched tokens) in
    `layout` at `budget_bytes`; a ConfigError's message when the kit refuses, as vLLM would."""
    try:
        return config_for_settings(layout, settings, budget_bytes)
    except ConfigError as e:
        return str(e)


def kv_agreement(layout: KVCacheLayout, settings, budget_bytes: int,
                 sizer: VLLMSizer | None = None) -> KVAgreement:
    """The kit's blocks and log line (its cache `layout` for `settings`) beside vLLM's for one
    configuration (no engine): vLLM's sizing of the specs its model builds from the kit's
    config.json, by `sizer` when given (built for these settings), else built here."""
    kit_side = kit_kv_config(layout, settings, budget_bytes)
    if sizer is not None:
        vllm_side = sizer.size(budget_bytes, settings.max_model_len,
                               settings.max_num_batched_tokens)
    else:
        vllm_side: VLLMKVSizing = vllm_kv_sizing(
            settings.arch, budget_bytes, block_size=settings.block_size,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_dtype=settings.kv_cache_dtype, dtype=settings.dtype,
            tensor_parallel_size=settings.tensor_parallel_size)
    refused = isinstance(kit_side, str)
    return KVAgreement(
        settings.arch.name, budget_bytes, settings.block_size, settings.kv_cache_dtype,
        settings.tensor_parallel_size, settings.max_model_len,
        None if refused else kit_side.num_blocks, vllm_side.num_blocks,
        None if refused else kit_side.log_line(), vllm_side.log_line,
        kit_side if refused else None, vllm_side.error)


def agreement_grid(preset: str, models, budgets, block_sizes, cache_dtypes,
                   tensor_parallel_sizes=(1,), max_model_len: int = 2048) -> list[KVAgreement]:
    """`kv_agreement` for every combination (each model's max_model_len capped at its own),
    the kit's layout and vLLM's model built once per model, block size, cache dtype and TP
    size (`VLLMSizer`)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="kit-vllm-grid-") as tmp:
        for model, block_size, cache_dtype, tp in itertools.product(
                models, block_sizes, cache_dtypes, tensor_parallel_sizes):
            arch = ModelConfig.load(model)
            settings = load(preset, sizing_only=True, model=model, block_size=block_size,
                            kv_cache_dtype=cache_dtype, tensor_parallel_size=tp,
                            max_model_len=min(max_model_len, arch.max_position_embeddings))
            sizer = sizer_or_none(settings, Path(tmp))
            layout = KVCacheLayout.for_settings(settings)
            out += [kv_agreement(layout, settings, parse_bytes(b), sizer) for b in budgets]
    return out


def sizer_or_none(settings, folder: Path) -> VLLMSizer | None:
    """vLLM's sizer for `settings` (the kit's config.json written under `folder`), or None
    when vLLM is missing or refuses the settings (`kv_agreement` then says why)."""
    if vllm_missing():
        return None
    try:
        model = write_model_folder(settings.arch, folder / safe_name(settings.arch.name))
        return VLLMSizer.build(model, block_size=settings.block_size,
                               max_model_len=settings.max_model_len,
                               kv_cache_dtype=settings.kv_cache_dtype, dtype=settings.dtype,
                               tensor_parallel_size=settings.tensor_parallel_size)
    except Exception:  # a refusal of the settings themselves: reported by `vllm_kv_sizing`
        return None


def engine_agreement(kit_side: KVCacheConfig | str, run) -> dict:
    """The kit's KV cache config (or its refusal) beside what a started engine (`EngineRun`)
    decided."""
    ok = not isinstance(kit_side, str) and run.ok
    return {**Count.of({"kit_blocks": kit_side.num_blocks if ok else None,
                        "vllm_blocks": run.num_blocks}),
            "kit_log_line": kit_side.log_line() if ok else None,
            "vllm_log_line": run.kv_log_line,
            **Bytes.of({"kit_cache_bytes": kit_side.cache_bytes if ok else None,
                        "vllm_cache_bytes": run.kv_cache_bytes}),
            "agree": ok and kit_side.num_blocks == run.num_blocks
            and kit_side.log_line() == run.kv_log_line
            and kit_side.cache_bytes == run.kv_cache_bytes}


# ---------------------------------------------------------------------------------------------
# The kit's decode step: where chapter 04's timing plugs in
# ---------------------------------------------------------------------------------------------

@dataclass
class KitDecode:
    """The kit's generations for one mode, in the same shape as vLLM's (`EngineRun`)."""

    mode: str
    strategy: str
    step_seconds: list[float] = field(default_factory=list)   # every decode step timed
    # the step's first call and, where this mode built it, the compiled prefill's: vLLM's one
    # compilation serves its prefill too (`prefill_compile_seconds`: that part alone)
    compile_seconds: float | None = None
    prefill_compile_seconds: float | None = None
    error: str | None = None
    prefills: list[float] = field(default_factory=list)       # per generation
    generations: list[float] = field(default_factory=list)    # per generation: prefill + steps
    tokens: list[list[int]] = field(default_factory=list)     # the first generation's, per seq

    @property
    def median(self) -> float | None:
        return median_or_none(self.step_seconds)

    @property
    def prefill_seconds(self) -> float | None:
        return median_or_none(self.prefills)

    @property
    def end_to_end_seconds(self) -> float | None:
        return median_or_none(self.generations)

    def summary(self) -> dict:
        return {"strategy": self.strategy, "median": Seconds.of(self.median), "error": self.error,
                **Seconds.of({"compile_seconds": self.compile_seconds,
                              "prefill_compile_seconds": self.prefill_compile_seconds})}


def off_reference(check) -> str:
    """Why a run failed its check against the no-cache reference, in one line."""
    routing = check.routing
    if routing is not None and not routing.ok:
        return (f"routed differently from the reference at a gap of "
                f"{max(routing.gaps):.1e} (beyond {routing.tolerance:.0e})")
    return f"logits off the no-cache reference by {check.max_error:.1e}"


def kit_strategy(mode: str, device: str) -> str:
    """The kit's strategy beside vLLM's mode: eager is eager; compiled is vLLM's way of
    compiling, one guard-free torch.compile, captured in CUDA graphs on a GPU."""
    if mode == "eager":
        return "eager"
    return "cuda_graphs" if device == "cuda" else "guard_free"


class KitTurns:
    """The kit's side of the decode comparison (chapter 04's paged decode), run in turns with
    vLLM's engine, which loads the kit's weights (`weights`) and prompts (an MoE's bytes follow
    its routing: on dummy weights vLLM's gpt-oss-like tokens all picked the same 4 of 32).
    `start(mode, strategy)` warms the strategy up (compiling it and, on the CPU, the prefill),
    then each `turn()` runs and times one whole generation (prefill, then `output_len - 1`
    steps), the first checked against the no-cache reference; `stop()` discards the runner.
    A failure is recorded in the mode's `error`, never raised (it runs in vLLM's loop)."""

    def __init__(self, settings, layout: KVCacheLayout):
        self.settings, self.steps = settings, settings.output_len - 1
        lens = prompt_lengths(settings.batch_size, settings.input_len)
        self.model = build_model(settings.arch, settings.dtype, settings.device, settings.seed)
        kv_cache = allocate(layout, peak_blocks(layout, lens, self.steps), settings.device)
        self.batch, self.prompts = decode_inputs(settings, layout, kv_cache)
        self.shared_prefill = SharedPrefill(self.model, self.batch, self.prompts)
        self.weights = write_checkpoint(self.model, weights_folder(settings.arch, settings.dtype,
                                                                   settings.seed))
        self.decodes: dict[str, KitDecode] = {}
        self.mode = self.runner = self.prefill = None

    def start(self, mode: str, strategy: str) -> KitDecode:
        decode = self.decodes[mode] = KitDecode(mode, strategy)
        self.mode, self.runner = mode, None
        try:
            built = self.shared_prefill.runner is None
            self.prefill = self.shared_prefill.for_strategy(strategy)
            if built and self.prefill is not None:
                decode.prefill_compile_seconds = self.prefill.compile_seconds
            self.runner, _ = warm_up(self.model, self.batch, self.prompts, self.steps, strategy,
                                     self.prefill)
            decode.compile_seconds = self.runner.compile_seconds + (
                decode.prefill_compile_seconds or 0.0)
        except Exception as e:  # noqa: BLE001 - the chapter goes on to vLLM's side
            decode.error = f"{type(e).__name__}: {e}"
        return decode

    def turn(self) -> None:
        decode = self.decodes[self.mode]
        if decode.error:
            return
        try:
            first = not decode.generations
            run = generate(self.model, self.batch, self.prompts, self.steps, step=self.runner,
                           keep_logits=first, prefill=self.prefill)
            decode.step_seconds += run.step_seconds
            decode.prefills.append(run.prefill_seconds)
            decode.generations.append(run.prefill_seconds + sum(run.step_seconds))
            if first:
                decode.tokens = run.tokens.tolist()
                check = check_routed_against_no_cache(self.model, self.batch, self.prompts, run,
                                                      self.settings.dtype, self.prefill, self.runner)
                if not check.ok:
                    decode.error = off_reference(check)
        except Exception as e:  # noqa: BLE001
            decode.error = f"{type(e).__name__}: {e}"

    def stop(self, turns_alone: int = 0) -> KitDecode:
        """End the mode's turns, first taking `turns_alone` more (when vLLM took none)."""
        for _ in range(turns_alone):
            self.turn()
        if self.runner is not None:
            self.runner.discard()
        return self.decodes[self.mode]

    def close(self) -> None:
        self.shared_prefill.discard()
        shutil.rmtree(self.weights, ignore_errors=True)


def side_by_side(settings, layout: KVCacheLayout, folder: Path, progress=print, modes=MODES,
                 strategy: str | None = None) -> tuple[dict[str, KitDecode], dict[str, EngineRun]]:
    """For each mode: the kit's strategy (`kit_strategy`'s match, or `strategy` beside every
    mode; decoding in the run's KV cache, `layout`) warmed up, then vLLM started in that mode,
    and after each of its generations (the warm-up's included) the kit runs one: both sides
    timed in the same minutes, so a busy neighbour slows both alike. Each engine is shut down
    before the next starts; its start-up log is saved in `folder`. Where vLLM does not start,
    the kit still times its generations alone."""
    kit = KitTurns(settings, layout)
    repeats = max(2, -(-DECODE_STEPS // max(1, kit.steps)))
    runs = {}
    try:
        for mode in modes:
            ours = strategy or kit_strategy(mode, settings.device)
            progress(f"kit {mode} ({ours}): warming up ...")
            decode = kit.start(mode, ours)
            prefill = decode.prefill_compile_seconds or 0.0
            progress(f"  {decode.error}" if decode.error else
                     f"  first call {decode.compile_seconds - prefill:.1f} s" + (
                         f", its compiled prefill {prefill:.1f} s" if prefill else ""))
            progress(f"starting vLLM ({mode}), the kit taking a turn after each generation ...")
            run = runs[mode] = run_settings(settings, mode, between=kit.turn, weights=kit.weights,
                                            prompts=[p.tolist() for p in kit.prompts])
            decode = kit.stop(turns_alone=0 if decode.generations else repeats + 1)
            log = run.save_log(folder)
            progress(f"  vLLM: {run.error}" if not run.ok else
                     f"  vLLM started in {run.startup_seconds:.1f} s (compile "
                     f"{run.compile_seconds or 0:.1f} s), {run.num_blocks:,} blocks of "
                     f"{run.block_size}, median step {run.decode_step_median * 1e3:.3f} ms; "
                     f"log: {log.name}")
            progress(f"  kit: {decode.error}" if decode.error else
                     f"  kit median step {decode.median * 1e3:.3f} ms over "
                     f"{len(decode.step_seconds)} steps")
    finally:
        kit.close()
    return kit.decodes, runs


# ---------------------------------------------------------------------------------------------
# The chapter's tables
# ---------------------------------------------------------------------------------------------

def kv_rows(kit_config: KVCacheConfig, runs: dict) -> list[dict]:
    """KV blocks, tokens, concurrency and bytes: the kit beside each started engine."""
    quantities = [("KV blocks", "num_blocks", "num_blocks"),
                  ("KV tokens (vLLM's 'KV cache size')", "num_tokens", "num_tokens"),
                  ("max concurrency", "max_concurrency", "max_concurrency"),
                  ("KV cache bytes", "cache_bytes", "kv_cache_bytes"),
                  ("block size (tokens)", None, "block_size")]
    rows = []
    for label, kit_attr, run_attr in quantities:
        kit_value = kit_config.layout.block_size if kit_attr is None \
            else getattr(kit_config, kit_attr)
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
    kit_prefill: float | None = None
    vllm_prefill: float | None = None
    kit_end_to_end: float | None = None    # one generation: prefill and every decode step
    vllm_end_to_end: float | None = None
    same_tokens: tuple[int, int] | None = None  # (equal, of): both sides' first generation

    @property
    def ratio(self) -> float | None:
        """kit ÷ vLLM: below 1 the kit's step is faster."""
        return _ratio(self.kit_step, self.vllm_step)

    @property
    def end_to_end_ratio(self) -> float | None:
        return _ratio(self.kit_end_to_end, self.vllm_end_to_end)

    def ms(self) -> tuple[float | None, float | None]:
        """(kit step, vLLM step) in milliseconds."""
        return _ms(self.kit_step), _ms(self.vllm_step)

    def row(self) -> dict:
        return {"mode": self.mode, "kit strategy": self.kit_strategy,
                "kit step (ms)": _fmt(_ms(self.kit_step)), "vLLM step (ms)": _fmt(_ms(self.vllm_step)),
                "kit ÷ vLLM": _fmt(self.ratio, 2), "kit compile (s)": _fmt(self.kit_compile, 1),
                "vLLM compile (s)": _fmt(self.vllm_compile, 1),
                "vLLM start-up (s)": _fmt(self.vllm_startup, 1),
                "same tokens": "{:,}/{:,}".format(*self.same_tokens) if self.same_tokens else "n/a"}

    def end_to_end_row(self) -> dict:
        """The same requests end to end: prefill, then the whole generation."""
        return {"mode": self.mode, "kit strategy": self.kit_strategy,
                "kit prefill (s)": _fmt(self.kit_prefill), "vLLM prefill (s)": _fmt(self.vllm_prefill),
                "kit end to end (s)": _fmt(self.kit_end_to_end),
                "vLLM end to end (s)": _fmt(self.vllm_end_to_end),
                "kit ÷ vLLM": _fmt(self.end_to_end_ratio, 2)}


def _ratio(kit: float | None, vllm: float | None) -> float | None:
    return None if kit is None or not vllm else kit / vllm


def _fmt(v, digits=3):
    return "n/a" if v is None else f"{v:,.{digits}f}"


def decode_comparison(kit_decodes: dict, runs: dict) -> list[DecodeComparison]:
    """Per mode: the kit's median step (`KitDecode`) beside vLLM's (`EngineRun`)."""
    out = []
    for mode, run in runs.items():
        k = kit_decodes.get(mode)
        out.append(DecodeComparison(
            mode, k.strategy if k else "-", k.median if k else None, run.decode_step_median,
            k.compile_seconds if k else None, run.compile_seconds, run.startup_seconds,
            k.prefill_seconds if k else None, run.prefill_median,
            k.end_to_end_seconds if k else None, run.end_to_end_median,
            same_tokens(k.tokens, run.tokens) if k else None))
    return out


def best_ratio(comparisons: list[DecodeComparison], end_to_end: bool = False) -> float | None:
    """The kit's best step over vLLM's best step (the target: at most 1.0); with
    `end_to_end`, the best whole generation over vLLM's best."""
    kit, vllm = ("kit_end_to_end", "vllm_end_to_end") if end_to_end else ("kit_step", "vllm_step")
    kit_best = [getattr(c, kit) for c in comparisons if getattr(c, kit) is not None]
    vllm_best = [getattr(c, vllm) for c in comparisons if getattr(c, vllm) is not None]
    if not kit_best or not vllm_best:
        return None
    return Ratio(min(kit_best) / min(vllm_best))


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


def vllm_concurrency(models, budget_bytes: int, lengths: list[int], *, block_size: int,
                     dtype: str, in_flight: int) -> dict[str, dict[str, list]]:
    """Chapter 02's lesson asked of vLLM's own code (`concurrency_curve`): for each model, max
    concurrency at each max_model_len as configured and with every layer full attention."""
    out = {}
    for name in models:
        curve = concurrency_curve(ModelConfig.load(name), budget_bytes, block_size=block_size,
                                  max_num_batched_tokens=in_flight, max_model_lens=lengths,
                                  dtype=dtype)
        out[name] = {**Ratio.of({"as configured": curve.windowed,
                                 "all full attention": curve.full}), "error": curve.error}
    return out
