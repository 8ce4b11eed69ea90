"""Chapter 02, building the KV cache: the blocks a budget buys (the arithmetic is
`kit.engine.kv_cache`), block tables handed to a batch of requests, the calculator behind the
chapter's widget, and the PR's Gemma-2B blocks turned into bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kit.config import ModelConfig, Settings, reference
from kit.engine.block_table import BlockAllocator, OutOfBlocks
from kit.engine.kv_groups import with_layer_pattern
from kit.engine.kv_cache import (BudgetSplit, KVCacheSpec, device_label,
                                 estimate_activation_bytes, in_flight_tokens, size_kv_cache,
                                 split_budget)
from kit.errors import ConfigError
from kit.units import Bytes, Count, Ratio

# The calculator's layer patterns: every n-th layer full attention, the rest sliding (0: the
# model's own layers, 1: every layer full, None: every layer sliding).
LAYER_PATTERNS = {"the model's own": 0, "all full attention": 1, "all sliding": None,
                  "1 full in 2 (Gemma 2)": 2, "1 full in 6 (Gemma 3)": 6}


def hand_out_blocks(num_blocks: int, settings: Settings) -> BlockAllocator:
    """`batch_size` requests of mixed prompt lengths up to `input_len` (7 tokens apart) get
    their blocks, then each generates `output_len` tokens: the allocator as it ends. Blocks of
    the size vLLM sizes the cache with (`KVCacheSpec.from_settings`)."""
    allocator = BlockAllocator(num_blocks, KVCacheSpec.from_settings(settings).block_size)
    prompt_lens = [max(1, settings.input_len - 7 * i) for i in range(settings.batch_size)]
    for seq, n in enumerate(prompt_lens):
        allocator.allocate(seq, n)
    for _ in range(settings.output_len):
        for seq in range(settings.batch_size):
            allocator.append_token(seq)
    return allocator


def requests_that_fit(num_blocks: int, settings: Settings) -> int:
    """How many requests of `max_model_len` tokens the block allocator hands blocks to before it
    runs out: the concurrency vLLM's start-up line states, counted instead of divided (for
    layers that all attend fully; a window's reservation is chapter 02's groups section)."""
    allocator = BlockAllocator(num_blocks, KVCacheSpec.from_settings(settings).block_size)
    held = 0
    try:
        while True:
            allocator.allocate(held, settings.max_model_len)
            held += 1
    except OutOfBlocks:
        return held


def concurrency_curve(arch: ModelConfig, budget_bytes: int, lengths: list[int], *,
                      block_size: int, dtype: str, in_flight: int) -> list[float | None]:
    """Max concurrency for requests of each length (None where vLLM would refuse)."""
    spec = KVCacheSpec.for_model(arch, block_size, dtype)
    out = []
    for n in lengths:
        try:
            out.append(size_kv_cache(spec, budget_bytes, n, in_flight_tokens=in_flight)
                       .max_concurrency)
        except ConfigError:
            out.append(None)
    return out


def windowed_and_full(arch: ModelConfig, budget_bytes: int, lengths: list[int],
                      **how) -> dict[str, list]:
    """The lesson of sliding windows: `concurrency_curve` as the model is, and with every
    layer full attention (`how`: block_size, dtype, in_flight)."""
    return Ratio.of({"as configured": concurrency_curve(arch, budget_bytes, lengths, **how),
                     "all full attention": concurrency_curve(with_layer_pattern(arch, 1),
                                                             budget_bytes, lengths, **how)})


# The lesson's setting (issue 23's measurement with vLLM 0.32): an 8 GiB cache in bf16, block
# 32, 2,048 batched tokens on the CPU (one step in flight), max_model_len from 512 to 32k.
LESSON = {"models": ("mistral-7b-v0.1", "gemma-3-1b"), "budget_bytes": 8 * 2**30,
          "lengths": [2**k for k in range(9, 16)],
          "how": {"block_size": 32, "dtype": "bfloat16", "in_flight": 2048}}


def lesson_curves() -> dict[str, dict[str, list]]:
    """`windowed_and_full` for each of the lesson's models at the lesson's setting."""
    return {name: windowed_and_full(ModelConfig.load(name), LESSON["budget_bytes"],
                                    LESSON["lengths"], **LESSON["how"])
            for name in LESSON["models"]}


def lesson_sizing(name: str, max_model_len: int = 32_768):
    """`name`'s cache at the lesson's setting (`KVCacheSizing`)."""
    how = LESSON["how"]
    spec = KVCacheSpec.for_model(ModelConfig.load(name), how["block_size"], how["dtype"])
    return size_kv_cache(spec, LESSON["budget_bytes"], max_model_len,
                         in_flight_tokens=how["in_flight"])


def curve_lines(curves: dict[str, dict[str, list]]) -> list[tuple[str, list, list, str]]:
    """`curves` as the lines `plots.concurrency_vs_len` draws (full attention dashed)."""
    return [(f"{name}, {label}", LESSON["lengths"], values,
             "dash" if label == "all full attention" else "solid")
            for name, by_label in curves.items() for label, values in by_label.items()]


def calculate(settings: Settings, measured_activation_bytes: int, model: str | None = None,
              **knobs) -> tuple[BudgetSplit, str]:
    """The calculator for `model` (default: the settings' model): the measured activations when
    it is the profiled model, else the kit's eager estimate; returns the split and which one
    ("measured" or "estimated"). `knobs`: `split_budget`'s arguments (capacity_bytes,
    gpu_memory_utilization, block_size, ...)."""
    profiled = model in (None, settings.model, settings.arch.name)
    arch = settings.arch if profiled else ModelConfig.load(model)
    arch = with_layer_pattern(arch, knobs.pop("full_every", 0), knobs.pop("sliding_window", 0) or None)
    if profiled:
        activations, source = measured_activation_bytes, "measured"
    else:
        activations, source = estimate_activation_bytes(
            arch, settings.max_num_batched_tokens, settings.max_num_seqs,
            settings.dtype_bytes), "estimated"
    knobs.setdefault("device_label", device_label(settings.device))  # the log line's "CPU"
    knobs.setdefault("in_flight_tokens", in_flight_tokens(settings))  # what a window reserves
    knobs.setdefault("device", settings.device)  # vLLM's CPU blocks for windows
    return split_budget(arch, settings.dtype, activation_bytes=activations, **knobs), source


def calculate_for_settings(settings: Settings, capacity: int,
                           measured_activation_bytes: int) -> BudgetSplit:
    """The calculator at the settings' own knobs (what the chapter's static figure shows)."""
    return calculate(settings, measured_activation_bytes, capacity_bytes=capacity,
                     gpu_memory_utilization=settings.gpu_memory_utilization,
                     block_size=settings.block_size, kv_cache_dtype=settings.kv_cache_dtype,
                     max_model_len=settings.max_model_len,
                     tensor_parallel_size=settings.tensor_parallel_size)[0]


@dataclass
class PRArithmetic:
    """The PR's Gemma-2B blocks in bytes, beside this run's eager and compiled profiles."""

    gemma: KVCacheSpec            # Gemma-2B's cache at the PR's block size, bf16
    pr_blocks: dict[str, int]     # {"compiled": 34552, "eager": 25752}
    here_blocks: dict[str, int]   # this run's blocks from each profile
    bytes_per_block: int          # this run's
    activation_delta: int         # eager peak - compiled peak, this run

    def pr_bytes(self, profile: str) -> int:
        return self.pr_blocks[profile] * self.gemma.bytes_per_block

    @property
    def pr_extra_bytes(self) -> int:
        """What the eager profile charged beyond the compiled one, in the PR."""
        return self.pr_bytes("compiled") - self.pr_bytes("eager")

    @property
    def here_extra_bytes(self) -> int:
        return (self.here_blocks["compiled"] - self.here_blocks["eager"]) * self.bytes_per_block

    def summary(self) -> dict:
        return {**Bytes.of({"pr_bytes_per_block": self.gemma.bytes_per_block,
                            "pr_compiled_kv_bytes": self.pr_bytes("compiled"),
                            "pr_eager_kv_bytes": self.pr_bytes("eager"),
                            "pr_eager_extra_activation_bytes": self.pr_extra_bytes}),
                "blocks_eager_profile": Count(self.here_blocks["eager"]),
                "blocks_compiled_profile": Count(self.here_blocks["compiled"])}


def pr_arithmetic(spec: KVCacheSpec, profiles: dict[str, dict]) -> PRArithmetic:
    """`profiles`: chapter 01's summaries ("eager", "compiled"); `spec`: this run's cache."""
    pr = reference("pr7796")
    gemma = KVCacheSpec.for_model(ModelConfig.load(pr["model"]), pr["block_size"],
                                  "bfloat16")
    here = {k: max(0, p["kv_cache_bytes"]) // spec.bytes_per_block for k, p in profiles.items()}
    peaks = {k: p["peak_activation_bytes"] for k, p in profiles.items()}
    return PRArithmetic(gemma, {"compiled": pr["kv_blocks_profile_compiled"],
                                "eager": pr["kv_blocks_profile_eager"]},
                        here, spec.bytes_per_block, peaks["eager"] - peaks["compiled"])
