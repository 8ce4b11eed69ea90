"""The real vLLM's engine started on a model folder: what it decided and how fast it decodes.

`run_engine(...)` starts `vllm.LLM` in this process with no tokenizer and dummy weights (or a
checkpoint's: `run_settings(weights=...)`, so that an MoE routes as the kit's model does), eager
(`enforce_eager=True`) or compiled, reads back what the engine decided (blocks, block size, KV
bytes, compilation mode and backend, start-up and compile time, the memory profile on a GPU),
times decode steps, keeps the engine's start-up log, and shuts the engine down.

Decode step time: the batch's requests go into vLLM's engine and each `LLMEngine.step()` (the
loop `LLM.generate` runs) is timed: greedy, end of sequence ignored, prefix caching off. The
first generation is a warm-up; of the others, the prefill step(s) are timed apart, the median
over every decode step is reported, and each whole generation is timed end to end. A step
holds everything vLLM does per step: scheduling, input preparation, the model, sampling,
output processing. (Timing whole generations of n and of 1 tokens and dividing the difference
by n - 1 gives the same on a quiet machine, but on a shared one each difference carries the
noise of two runs.)

When vLLM is missing or cannot start, the functions return a result whose `error` is a message
saying why and what to do, never a traceback, so a notebook can go on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from kit.measure.timing import Timings, median_or_none
from kit.units import Bytes, Count, Ratio, Seconds, typed
from kit.vllm.installed import hooks_released, in_process, inspected_here, vllm_missing
from kit.vllm.kv_sizing import engine_config
from kit.vllm.model_specs import model_kv_specs
from kit.vllm.log import captured_vllm_log, fail_message, format_records, phase_seconds
from kit.vllm.model_folder import safe_name, write_model_folder

MODES = ("eager", "compiled")
RUN_QUANTITIES = {  # what `EngineRun`'s numbers measure
    Count: ("num_blocks", "block_size", "num_tokens", "decode_batch_size", "decode_input_len",
            "decode_output_len", "torch_threads"),
    Bytes: ("bytes_per_block", "kv_cache_bytes"), Ratio: ("max_concurrency",),
    Seconds: ("startup_seconds", "compile_seconds", "decode_step_seconds", "prefill_seconds",
              "generation_seconds")}
DECODE_STEPS = 90  # decode steps timed per engine run: enough for a median on a noisy machine


@dataclass
class EngineRun:
    """What one start of `vllm.LLM` decided and measured. `error` set: it did not start."""

    mode: str  # "eager" or "compiled"
    model: str
    error: str | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    bytes_per_block: int | None = None
    kv_cache_bytes: int | None = None
    num_tokens: int | None = None
    max_concurrency: float | None = None
    kv_log_line: str | None = None
    compilation_mode: str | None = None
    compile_backend: str | None = None
    cudagraph_mode: str | None = None
    startup_seconds: float | None = None
    compile_seconds: float | None = None
    memory: dict | None = None  # the profile vLLM computed (GPU; None on the CPU)
    decode_step_seconds: list[float] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)      # per timed generation
    generation_seconds: list[float] = field(default_factory=list)   # per timed generation
    decode_batch_size: int | None = None
    decode_input_len: int | None = None
    decode_output_len: int | None = None
    torch_threads: int | None = None  # intra-op threads the engine's model ran with
    specs_as_built: bool | None = None  # engine's KV specs == `specs_without_engine`'s
    tokens: list[list[int]] = field(default_factory=list)  # first generation's, per request
    log: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def decode_step_median(self) -> float | None:
        return median_or_none(self.decode_step_seconds)

    @property
    def decode_step_spread(self) -> float | None:
        """p90 - p10 of the per-step samples, in seconds."""
        return Timings(self.decode_step_seconds).spread if self.decode_step_seconds else None

    @property
    def end_to_end_median(self) -> float | None:
        """A whole generation (prefill and every decode step), the median over the timed ones."""
        return median_or_none(self.generation_seconds)

    @property
    def prefill_median(self) -> float | None:
        return median_or_none(self.prefill_seconds)

    def summary(self) -> dict:
        """Numbers for `Recorder.record` (the log goes to a file, see `save_log`)."""
        out = typed({k: v for k, v in asdict(self).items() if k not in ("log", "tokens")},
                    RUN_QUANTITIES)  # token ids are no quantity: `same_tokens` compares them
        out.update(ok=self.ok, memory=self.memory, **Seconds.of({
            "decode_step_median": self.decode_step_median,
            "decode_step_spread": self.decode_step_spread, "prefill_median": self.prefill_median,
            "end_to_end_median": self.end_to_end_median}))
        return out

    def save_log(self, folder: Path) -> Path:
        """Write the engine's start-up log next to the run's results."""
        path = Path(folder) / f"vllm-{safe_name(self.model)}-{self.mode}.log"
        path.write_text("\n".join(self.log) + "\n")
        return path


def engine_kwargs(model_folder: Path, mode: str, *, block_size: int, max_model_len: int,
                  max_num_seqs: int, max_num_batched_tokens: int, dtype: str,
                  kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
                  gpu_memory_utilization: float = 0.9, seed: int = 0,
                  load_format: str = "dummy") -> dict:
    """The `vllm.LLM(...)` arguments for one run: dummy weights (`load_format="auto"`: the
    folder's checkpoint), no tokenizer, no prefix cache (each timed generation must do its full
    prefill)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    return dict(model=str(model_folder), load_format=load_format, skip_tokenizer_init=True,
                use_tqdm_on_load=False,  # a checkpoint's load draws no progress bar
                enforce_eager=mode == "eager", block_size=block_size,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
                seed=seed)


def specs_without_engine(vc) -> dict:
    """The layer specs the no-engine path (`kit.vllm.kv_sizing`) builds for a started
    engine's model folder and settings: a fresh config, its model on the meta device."""
    mc, cc = vc.model_config, vc.cache_config
    fresh = engine_config(Path(mc.model), block_size=cc.block_size,
                          kv_cache_dtype=cc.cache_dtype, max_model_len=mc.max_model_len,
                          dtype=str(mc.dtype).removeprefix("torch."),
                          tensor_parallel_size=vc.parallel_config.tensor_parallel_size,
                          enable_prefix_caching=cc.enable_prefix_caching)
    return model_kv_specs(fresh)


def _read_engine(llm, run: EngineRun, records: list) -> None:
    """Fill `run` with what the started engine decided."""
    vc = llm.llm_engine.vllm_config
    cc, comp = vc.cache_config, vc.compilation_config
    run.num_blocks, run.block_size = cc.num_gpu_blocks, cc.block_size
    run.num_tokens = getattr(cc, "kv_cache_size_tokens", None)
    run.max_concurrency = getattr(cc, "kv_cache_max_concurrency", None)
    run.compilation_mode = getattr(comp.mode, "name", str(comp.mode))
    run.compile_backend = comp.backend or None
    run.cudagraph_mode = getattr(comp.cudagraph_mode, "name", str(comp.cudagraph_mode))
    # On a GPU vLLM times torch.compile itself; on the CPU (mode DYNAMO_TRACE_ONCE) it compiles
    # during the warm-up it logs, so the warm-up's span is the compile time.
    run.compile_seconds = 0.0 if run.compilation_mode == "NONE" else (
        comp.compilation_time or phase_seconds(records, "Warming up model for the compilation",
                                                "Warming up done"))
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process client
    if core is not None:
        # the engine's own layer specs, beside those the no-engine path builds
        engine_specs = core.model_executor.get_kv_cache_specs()[0]
        run.specs_as_built = engine_specs == specs_without_engine(vc)
        kv = core.scheduler.kv_cache_config
        # groups' tensors alias one allocation: a block id costs the pool's bytes per block
        from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block
        run.bytes_per_block = _pool_bytes_per_block(vc, kv.kv_cache_groups)
        run.kv_cache_bytes = run.bytes_per_block * kv.num_blocks
        if vc.device_config.device_type == "cuda":
            run.memory = _gpu_memory_profile(core)
    run.kv_log_line = next((r.getMessage() for r in records
                            if "KV cache size:" in r.getMessage()), None)


def _gpu_memory_profile(core) -> dict | None:
    """The figures vLLM's GPU worker computed while profiling (absent when
    kv_cache_memory_bytes skipped the profile)."""
    worker = getattr(getattr(core.model_executor, "driver_worker", None), "worker", None)
    if worker is None or not hasattr(worker, "peak_activation_memory"):
        return None
    weights = int(worker.model_runner.model_memory_usage)
    consumed = int(getattr(worker, "total_consumed", 0))
    return Bytes.of({"weights_bytes": weights,
                     "peak_activation_bytes": int(worker.peak_activation_memory),
                     # mem_get_info's consumption beyond the weights
                     "non_torch_and_other_bytes": consumed - weights,
                     "requested_bytes": int(worker.requested_memory),
                     "kv_cache_budget_bytes": int(worker.available_kv_cache_memory_bytes)})


class EngineTimings(NamedTuple):
    """Seconds of vLLM's engine loop over the timed generations."""

    decode_steps: list[float]   # every decode step of every generation
    prefills: list[float]       # per generation: the step(s) until every request had a token
    generations: list[float]    # per generation: every step, prefill included (end to end)
    tokens: list[list[int]]     # the warm-up generation's tokens, per request in order


def engine_timings(llm, batch_size: int, input_len: int, output_len: int, vocab_size: int,
                   repeats: int = 5, seed: int = 0, between=None,
                   prompts: list[list[int]] | None = None) -> EngineTimings:
    """Time vLLM's engine loop over `repeats` generations of `output_len` tokens for
    `batch_size` prompts of `input_len` tokens (greedy, end of sequence ignored), each step
    timed; the first generation is a warm-up. `prompts`: the same token ids every generation
    (the kit's, so both sides do the same work: an MoE's steps read the experts its tokens
    pick); default: random ones drawn from `seed`. A generation's prefill is its steps until every
    request has its first token; its decode steps are the rest. `between()`, when given, is
    called after each generation (the warm-up's included): the kit's turn, so that both sides
    are timed in the same minutes of a shared machine."""
    from vllm import SamplingParams
    if output_len < 2:
        raise ValueError("output_len must be at least 2 to see a decode step")
    rng = random.Random(seed)
    # ignore_eos alone runs to output_len; min_tokens would censor EOS too, work the kit's
    # sampling does not do (`kit.vllm.greedy`)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    engine = llm.llm_engine
    out = EngineTimings([], [], [], [])
    for rep in range(repeats + 1):  # the first generation is a warm-up
        for i in range(batch_size):
            ids = prompts[i] if prompts else [rng.randrange(vocab_size) for _ in range(input_len)]
            engine.add_request(f"kit-{rep}-{i}", {"prompt_token_ids": ids}, params)
        steps, tokens, finished = [], [], {}
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - t0)
            tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
            finished.update({o.request_id: list(o.outputs[0].token_ids)
                             for o in outputs if o.finished})
        if not rep:
            out.tokens.extend(finished[f"kit-0-{i}"] for i in range(batch_size))
        first = next(i for i, n in enumerate(tokens) if n >= batch_size) + 1
        if rep:
            out.decode_steps.extend(steps[first:])
            out.prefills.append(sum(steps[:first]))
            out.generations.append(sum(steps))
        if between is not None:
            between()
    return out


def shutdown(llm) -> None:
    """Stop the engine and free its memory, so another can start in this process."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def keep_torch_threads():
    """vLLM's CPU worker replaces torch.set_num_threads for the whole process; put it back so
    the kit's own timings after an engine run use the same threads as before."""
    import torch
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def run_engine(model_folder: Path, mode: str, *, name: str | None = None,
               decode: tuple[int, int, int] | None = None, vocab_size: int | None = None,
               repeats: int = 10, echo_log: bool = False, between=None, prompts=None,
               **kwargs) -> EngineRun:
    """Start `vllm.LLM` on `model_folder` (`mode` "eager" or "compiled"), read what it decided,
    time decode steps when `decode=(batch_size, input_len, output_len)` (calling `between()`
    after each generation, feeding `prompts` when given: see `engine_timings`), shut it down.
    `kwargs` go to `engine_kwargs`. Never raises for vLLM's failures: see `EngineRun.error`."""
    run = EngineRun(mode=mode, model=name or Path(model_folder).name)
    missing = vllm_missing()
    if missing:
        run.error = missing
        return run
    in_process()
    import torch
    from vllm import LLM
    llm, records = None, []
    args = engine_kwargs(model_folder, mode, **kwargs)
    with keep_torch_threads(), hooks_released(), inspected_here(), \
            captured_vllm_log(records, echo=echo_log):
        try:
            t0 = time.perf_counter()
            llm = LLM(**args)
            run.startup_seconds = time.perf_counter() - t0
            run.torch_threads = torch.get_num_threads()
            _read_engine(llm, run, records)
            if decode:
                batch_size, input_len, output_len = decode
                run.decode_batch_size, run.decode_input_len, run.decode_output_len = decode
                timed = engine_timings(llm, batch_size, input_len, output_len,
                                       vocab_size or 1000, repeats, kwargs.get("seed", 0),
                                       between, prompts)
                (run.decode_step_seconds, run.prefill_seconds, run.generation_seconds,
                 run.tokens) = timed
        except Exception as e:  # vLLM's own refusal: keep the message, drop the traceback
            run.error = fail_message(e)
            records.append(logging.makeLogRecord(
                {"name": "kit", "levelname": "ERROR", "msg": f"{type(e).__name__}: {e}"}))
        finally:
            if llm is not None:
                shutdown(llm)
                llm = None
            gc.collect()
    run.log = format_records(records)
    return run


def run_settings(settings, mode: str, folder: Path | None = None, *, block_size: int | None = None,
                 kv_cache_memory_bytes: int | None = None, decode: bool = True,
                 repeats: int | None = None, echo_log: bool = False,
                 profile_memory: bool = False, between=None, weights: Path | None = None,
                 prompts: list[list[int]] | None = None) -> EngineRun:
    """`run_engine` for the kit's `Settings`: the same model, dtype, batch and lengths;
    `block_size` and `kv_cache_memory_bytes` override the settings' (the chapter passes the same
    values to both sides). `repeats`: generations timed (None: about `DECODE_STEPS` decode steps
    in all). `profile_memory`: no fixed KV budget, so vLLM profiles the memory
    and sizes the cache from gpu_memory_utilization (on a GPU; `EngineRun.memory`).
    `weights`: a checkpoint folder (`kit.engine.checkpoint.write_checkpoint`) vLLM loads instead
    of dummy weights; `prompts`: the token ids every timed generation feeds."""
    arch = settings.arch
    if repeats is None:  # generations of output_len tokens: about DECODE_STEPS decode steps
        repeats = max(2, -(-DECODE_STEPS // max(1, settings.output_len - 1)))
    if profile_memory:
        settings = replace(settings, kv_cache_memory_bytes=None)
        kv_cache_memory_bytes = None
    model = weights or write_model_folder(arch, folder and Path(folder) / safe_name(arch.name))
    return run_engine(
        model, mode, name=arch.name, vocab_size=arch.vocab_size, repeats=repeats,
        prompts=prompts, load_format="auto" if weights else "dummy",
        decode=(settings.batch_size, settings.input_len, settings.output_len) if decode else None,
        echo_log=echo_log, between=between, block_size=block_size or settings.block_size,
        max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, dtype=settings.dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        kv_cache_memory_bytes=kv_cache_memory_bytes or settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization, seed=settings.seed)
