"""Chapter 02, building the KV cache: the blocks a budget buys (the arithmetic is
`kit.engine.kv_cache`), block tables handed to a batch of requests by the block manager, the
calculator behind the chapter's widget, and the PR's Gemma-2B blocks turned into bytes.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace

from kit.config import ModelConfig, Settings, reference, with_layer_pattern
from kit.engine.block_manager import GroupedBlockTables
from kit.engine.budget import MemoryBudget, estimate_activation_bytes, weights_budget
from kit.engine.kv_cache import (KVCacheConfig, KVCacheLayout, device_label, in_flight_tokens,
                                 kv_cache_config, too_few_states)
from kit.errors import ConfigError
from kit.units import Bytes, Count, GiB, Ratio, fmt_memory

# The calculator's layer patterns: every n-th layer full attention, the rest sliding (0: the
# model's own layers, 1: every layer full, None: every layer sliding).
LAYER_PATTERNS = {"the model's own": 0, "all full attention": 1, "all sliding": None,
                  "1 full in 2 (Gemma 2)": 2, "1 full in 6 (Gemma 3)": 6}


def hand_out_blocks(config: KVCacheConfig, settings: Settings) -> GroupedBlockTables:
    """`batch_size` requests of mixed prompt lengths up to `input_len` (7 tokens apart) get
    their blocks from the block manager, then each generates `output_len` tokens: the tables
    as they end, in the run's KV cache (`config`)."""
    tables = GroupedBlockTables(config.num_blocks, config.layout.groups)
    prompt_lens = [max(1, settings.input_len - 7 * i) for i in range(settings.batch_size)]
    for seq, n in enumerate(prompt_lens):
        tables.allocate_slots(seq, n)
    for _ in range(settings.output_len):
        for seq in range(settings.batch_size):
            tables.allocate_slots(seq, 1)
    return tables


def requests_that_fit(config: KVCacheConfig) -> int:
    """How many requests of `max_model_len` tokens the block manager admits, one after another,
    each prefilled in steps of the tokens in flight as vLLM's scheduler chunks a prefill (a
    window or chunk hands blocks back between steps): the concurrency vLLM's start-up line
    states, counted instead of divided. Full attention admits ⌊max concurrency⌋ (one fewer
    where the null block is the one missing); a window or chunk at least that many, as vLLM's
    own `KVCacheManager` does (a request holds less than it reserves once its prefill ends)."""
    tables = GroupedBlockTables(config.num_blocks, config.layout.groups)
    length, in_flight = config.max_model_len, config.in_flight_tokens
    step = in_flight or length
    held = 0
    while tables.admits(length, length, in_flight):
        for start in range(0, length, step):
            tables.allocate_slots(held, min(step, length - start))
        held += 1
    return held


def block_manager_config(config: KVCacheConfig, settings: Settings) -> KVCacheConfig:
    """The config the kit's block manager runs: `config` itself, or for a hybrid the one vLLM
    derives with prefix caching off. The manager keeps one state per request there
    (`mamba_cache_mode` "none"), where vLLM's default ("align") reserves two or three and so
    states a lower concurrency than the blocks admit."""
    if not config.layout.has_states:
        return config
    return replace(config, layout=KVCacheLayout.for_settings(settings, prefix_caching=False))


def concurrency_by_length(arch: ModelConfig, budget_bytes: int, lengths: list[int], *,
                          block_size: int, dtype: str, in_flight: int) -> list[float | None]:
    """Max concurrency for requests of each length (None where vLLM would refuse)."""
    layout = KVCacheLayout.for_model(arch, block_size, dtype)
    out = []
    for n in lengths:
        try:
            out.append(kv_cache_config(layout, budget_bytes, n, in_flight_tokens=in_flight)
                       .max_concurrency)
        except ConfigError:
            out.append(None)
    return out


def windowed_and_full(arch: ModelConfig, budget_bytes: int, lengths: list[int],
                      **how) -> dict[str, list]:
    """The lesson of sliding windows: `concurrency_by_length` as the model is, and with every
    layer full attention (`how`: block_size, dtype, in_flight)."""
    full = with_layer_pattern(arch, 1)
    return Ratio.of({"as configured": concurrency_by_length(arch, budget_bytes, lengths, **how),
                     "all full attention": concurrency_by_length(full, budget_bytes, lengths,
                                                                 **how)})


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


def lesson_config(name: str, max_model_len: int = 32_768) -> KVCacheConfig:
    """`name`'s cache at the lesson's setting."""
    how = LESSON["how"]
    layout = KVCacheLayout.for_model(ModelConfig.load(name), how["block_size"], how["dtype"])
    return kv_cache_config(layout, LESSON["budget_bytes"], max_model_len,
                           in_flight_tokens=how["in_flight"])


def curve_lines(curves: dict[str, dict[str, list]]) -> list[tuple[str, list, list, str]]:
    """`curves` as the lines `plots.concurrency_vs_len` draws (full attention dashed)."""
    return [(f"{name}, {label}", LESSON["lengths"], values,
             "dash" if label == "all full attention" else "solid")
            for name, by_label in curves.items() for label, values in by_label.items()]


# Memory of common accelerators, GiB (T4/V100 16, L4/A10 24, A100 40, L40S 48, A100/H100 80,
# H100 NVL 94, H200 141, B200 192): where the calculator opens for a model that does not fit.
COMMON_DEVICES_GIB = (16, 24, 40, 48, 80, 94, 141, 192)


@dataclass(frozen=True)
class Calculation:
    """One answer of the calculator: how the device's memory splits, and what the KV cache's
    share buys; `activations` says whether the activations were "measured" or "estimated"."""

    budget: MemoryBudget
    config: KVCacheConfig
    activations: str
    refusal: str | None = None  # why vLLM would not start with these blocks (`too_few_states`)

    @property
    def missing_bytes(self) -> int:
        """What the KV cache lacks to hold one request of max_model_len (vLLM refuses to
        start below that): 0 when it does."""
        need = self.config.layout.request_bytes(self.config.max_model_len,
                                                self.config.in_flight_tokens)
        return max(0, need - self.budget.kv_cache_bytes)

    @property
    def needed_capacity_bytes(self) -> int:
        """The device memory whose budget, at this gpu_memory_utilization, holds the weights,
        the activations and one request of max_model_len."""
        b = self.budget
        return math.ceil((b.budget_bytes + self.missing_bytes) / b.gpu_memory_utilization)

    def fit_advice(self, fixes: list[dict] | None = None, most_memory: int | None = None
                   ) -> str | None:
        """When the KV cache cannot hold one request of max_model_len: by how much, and what
        would (None when it can). `fixes` (`Calculator.fixes`): the settings within the
        controls' reach that fit, named instead of a generic list; `most_memory`: the most
        device memory the controls reach."""
        short = self.missing_bytes
        if not short:
            return None
        b, need = self.budget, self.needed_capacity_bytes / GiB
        head = (f"Does not fit: weights {b.weights_bytes / GiB:,.2f} GiB + activations "
                f"{b.activation_bytes / GiB:,.2f} GiB leave "
                f"{max(0, b.kv_cache_bytes) / GiB:,.2f} GiB of the {b.budget_bytes / GiB:,.2f} "
                f"GiB budget (capacity × gpu_memory_utilization), {short / GiB:,.2f} GiB short "
                f"of one {self.config.max_model_len:,}-token request.")
        if fixes is None:
            return (f"{head} Give device_memory at least {need:,.2f} GiB, or raise "
                    "gpu_memory_utilization or tensor_parallel_size, or lower max_model_len.")
        beyond = (f", more than the controls reach ({fmt_memory(most_memory)})"
                  if most_memory and need * GiB > most_memory else "")
        head += f" At these settings it needs device_memory {need:,.2f} GiB{beyond}."
        if not fixes:
            return (f"{head} Within the controls' reach no knob alone makes it fit, nor "
                    "tensor_parallel_size with device_memory.")
        return f"{head} Any one of these fits it: " + "; ".join(map(fix_text, fixes)) + "."


def fix_text(fix: dict) -> str:
    """One of `Calculator.fixes` as the controls name it: `device_memory 16 GiB`."""
    return " with ".join(f"device_memory {fmt_memory(v)}" if k == "capacity_bytes"
                         else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:g}"
                         for k, v in fix.items())


# The direction in which each knob gives the KV cache more room.
MORE_ROOM = {"capacity_bytes": 1, "gpu_memory_utilization": 1, "tensor_parallel_size": 1,
             "max_model_len": -1}


def calculate(settings: Settings, measured_activation_bytes: int, model: str | None = None, *,
              capacity_bytes: int, gpu_memory_utilization: float, block_size: int,
              kv_cache_dtype: str, max_model_len: int, tensor_parallel_size: int = 1,
              full_every: int | None = 0, sliding_window: int | None = None) -> Calculation:
    """The calculator for one rank of `model` (default: the settings' model): the measured
    activations when it is the profiled model, else the kit's eager estimate. `full_every`
    and `sliding_window` change its layers (`with_layer_pattern`); the device, batched tokens
    and dtype are the settings'."""
    profiled = model in (None, settings.model, settings.arch.name)
    arch = settings.arch if profiled else ModelConfig.load(model)
    arch = with_layer_pattern(arch, full_every, sliding_window or None)
    activations = measured_activation_bytes if profiled else estimate_activation_bytes(
        arch, settings.max_num_batched_tokens, settings.max_num_seqs, settings.dtype_bytes)
    budget = weights_budget(arch, settings.dtype, capacity_bytes, gpu_memory_utilization,
                            tensor_parallel_size, activations)
    layout = KVCacheLayout.for_model(arch, block_size, settings.dtype, kv_cache_dtype,
                                     tensor_parallel_size, settings.device)
    config = KVCacheConfig(layout, max(0, budget.kv_cache_bytes), max_model_len,
                           device_label(settings.device), in_flight_tokens(settings))
    return Calculation(budget, config, "measured" if profiled else "estimated",
                       too_few_states(config, settings.max_num_seqs, settings.device))


@dataclass(frozen=True)
class Calculator:
    """`calculate` for the settings and their measured activations, as a function of the
    widget's knobs (`kit.show.widgets.kv_calculator` calls it on every change), and where its
    memory opens for a model that does not fit the notebook's device."""

    settings: Settings
    measured_activation_bytes: int
    devices_gib: tuple[int, ...] = COMMON_DEVICES_GIB

    def __call__(self, **knobs) -> Calculation:
        return calculate(self.settings, self.measured_activation_bytes, **knobs)

    def start_capacity(self, knobs: dict) -> int | None:
        """The smallest common device (`devices_gib`) whose KV cache holds one request of
        max_model_len at the other `knobs`, or None when none does."""
        for gib in self.devices_gib:
            if not self(**knobs, capacity_bytes=gib * GiB).missing_bytes:
                return gib * GiB
        return None

    def fixes(self, knobs: dict, reachable: dict[str, list]) -> list[dict]:
        """What makes one request of max_model_len fit at `knobs` (the full set, memory
        included), within `reachable` (knob -> the values its control reaches): for each
        knob alone the nearest value that does; when none does, the least
        tensor_parallel_size that does with the least memory."""
        found = [f for name in reachable if name in MORE_ROOM
                 and (f := self.nearest_fix(knobs, name, reachable[name]))]
        if found or "capacity_bytes" not in reachable:
            return found
        for tp in sorted(t for t in reachable.get("tensor_parallel_size", ())
                         if t > knobs["tensor_parallel_size"]):
            memory = self.nearest_fix({**knobs, "tensor_parallel_size": tp}, "capacity_bytes",
                                      reachable["capacity_bytes"])
            if memory:
                return [{"tensor_parallel_size": tp, **memory}]
        return []

    def nearest_fix(self, knobs: dict, name: str, values: list) -> dict | None:
        """{name: the value nearest knobs[name], among `values`, that fits}, or None."""
        sign = MORE_ROOM[name]
        for value in sorted((v for v in values if (v - knobs[name]) * sign > 0),
                            key=lambda v: v * sign):
            try:
                if not self(**{**knobs, name: value}).missing_bytes:
                    return {name: value}
            except ValueError:  # e.g. a tensor_parallel_size that does not divide the heads
                continue
        return None


@dataclass
class PRArithmetic:
    """The PR's Gemma-2B blocks in bytes, beside this run's eager and compiled profiles."""

    gemma: KVCacheLayout          # Gemma-2B's cache at the PR's block size, bf16
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


def pr_arithmetic(layout: KVCacheLayout, profiles: dict[str, dict]) -> PRArithmetic:
    """`profiles`: chapter 01's summaries ("eager", "compiled"); `layout`: this run's cache."""
    pr = reference("pr7796")
    gemma = KVCacheLayout.for_model(ModelConfig.load(pr["model"]), pr["block_size"],
                                    "bfloat16")
    here = {k: max(0, p["kv_cache_bytes"]) // layout.bytes_per_block
            for k, p in profiles.items()}
    peaks = {k: p["peak_activation_bytes"] for k, p in profiles.items()}
    return PRArithmetic(gemma, {"compiled": pr["kv_blocks_profile_compiled"],
                                "eager": pr["kv_blocks_profile_eager"]},
                        here, layout.bytes_per_block, peaks["eager"] - peaks["compiled"])
