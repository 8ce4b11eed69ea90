"""Building the KV cache (chapter 02): bytes per block, blocks from a budget, real allocation.

The arithmetic is vLLM's, written once here and shown in the notebooks:

    page            = 2 (K and V) × num_kv_heads per rank × head_dim × cache dtype bytes × block_size
    bytes per block = page × layers in the widest KV cache group (all layers when they all
                      attend alike)
    num_blocks      = floor(KV budget / bytes per block)
    max concurrency = num_blocks / Σ over groups of the blocks one request reserves
                      (ceil(max_model_len / block_size) for full attention)

Layers with a sliding window make their own groups and reserve only what their window needs
(`kit.engine.kv_groups`).

With tensor parallelism each rank holds max(1, num_kv_heads // tp) heads: heads are replicated
when there are fewer KV heads than ranks, as vLLM does. The budget the cache gets is vLLM's too:
capacity × gpu_memory_utilization (`memory_budget`), less what the profiling run measured
(chapter 01), or `kv_cache_memory_bytes` when given (`kv_budget`). Only the allocation needs
torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kit.config import DTYPE_BYTES, KV_CACHE_DTYPES, check_kv_cache_dtype, check_tensor_parallel
from kit.engine.kv_groups import KVGroup, group_size, kv_groups, layer_windows
from kit.errors import ConfigError
from kit.units import Bytes, Count, Ratio


def memory_budget(capacity_bytes: int, gpu_memory_utilization: float) -> int:
    """The memory the engine may use: capacity × gpu_memory_utilization (vLLM's requested
    memory), which weights, activations and the KV cache share."""
    return int(capacity_bytes * gpu_memory_utilization)


def device_label(device: str) -> str:
    """How vLLM names the device in its log lines ("GPU" for CUDA, else "CPU", ...)."""
    return "GPU" if device == "cuda" else device.upper()


def cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_CACHE_DTYPES[kv_cache_dtype] or DTYPE_BYTES[model_dtype]


def in_flight_tokens(settings) -> int:
    """Tokens scheduled but not yet settled, which a sliding window keeps beside its W - 1:
    max_num_batched_tokens per step in flight, two steps with async scheduling (vLLM's default
    on CUDA), one on the CPU where vLLM turns it off (`VllmConfig.max_in_flight_tokens`)."""
    return settings.max_num_batched_tokens * (2 if settings.device == "cuda" else 1)


CPU_KERNEL_BLOCK = 32  # vLLM's CPU attention takes blocks in multiples of this


def engine_block_size(block_size: int, windows: tuple, device: str | None) -> int:
    """The block vLLM sizes the cache with: `block_size`, except on the CPU for a model with
    sliding windows, whose window layers take the CPU kernel's blocks (multiples of 32:
    `_largest_kernel_block_within` in vLLM's `Attention.get_kv_cache_spec`), and then the
    whole cache is sized at that block (block_size 16 sizes as 32)."""
    if device == "cpu" and windows and block_size % CPU_KERNEL_BLOCK:
        return -(-block_size // CPU_KERNEL_BLOCK) * CPU_KERNEL_BLOCK
    return block_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    return max(1, num_kv_heads // tensor_parallel_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's paged KV cache."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype_bytes: int
    kv_cache_dtype: str = "auto"
    windows: tuple = ()  # each layer's sliding window, None for full attention; (): all full

    @classmethod
    def for_model(cls, arch, block_size: int, model_dtype: str, kv_cache_dtype: str = "auto",
                  tensor_parallel_size: int = 1, device: str | None = None) -> "KVCacheSpec":
        """`device` "cpu": blocks as vLLM's CPU attention takes them (`engine_block_size`)."""
        check_tensor_parallel(arch, tensor_parallel_size)
        windows = layer_windows(arch)
        return cls(num_layers=arch.num_hidden_layers,
                   num_kv_heads=kv_heads_per_rank(arch.num_key_value_heads, tensor_parallel_size),
                   head_dim=arch.head_dim, block_size=engine_block_size(block_size, windows, device),
                   dtype_bytes=cache_dtype_bytes(kv_cache_dtype, model_dtype),
                   kv_cache_dtype=kv_cache_dtype, windows=windows)

    @classmethod
    def from_settings(cls, settings) -> "KVCacheSpec":
        return cls.for_model(settings.arch, settings.block_size, settings.dtype,
                             settings.kv_cache_dtype, settings.tensor_parallel_size,
                             settings.device)

    def formula(self) -> str:
        """The bytes-per-block arithmetic written out with this spec's numbers."""
        layers = f"{self.group_size} layers"
        if len(self.groups) > 1:
            layers += f" (the widest of {len(self.groups)} KV cache groups)"
        return (f"2 × {layers} × {self.num_kv_heads} KV heads × {self.head_dim} "
                f"head_dim × {self.dtype_bytes} B × {self.block_size} tokens = "
                f"{self.bytes_per_block:,} B per block")

    @property
    def bytes_per_token(self) -> int:
        """One token's keys and values in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        """One layer's block: vLLM's `page_size_bytes`."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes * self.block_size

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return kv_groups(self.windows or (None,) * self.num_layers)

    @property
    def group_size(self) -> int:
        return group_size(self.groups)

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in each layer of the widest group."""
        return self.group_size * self.page_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """Block ids one request of max_model_len tokens reserves, over all groups."""
        return sum(g.blocks_per_request(max_model_len, self.block_size, in_flight_tokens)
                   for g in self.groups)

    def request_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        """The bytes vLLM checks one request against: the block ids it reserves over all
        groups, each costing bytes_per_block, so a group with fewer layers than the widest
        counts as full width (`_max_memory_usage_bytes_from_groups`)."""
        return self.bytes_per_block * self.blocks_per_request(max_model_len, in_flight_tokens)


@dataclass(frozen=True)
class KVCacheSizing:
    """How many blocks a budget buys, and what that means in tokens and requests."""

    spec: KVCacheSpec
    budget_bytes: int
    max_model_len: int
    device_label: str = "GPU"  # as vLLM's log line names the device (`device_label`)
    in_flight_tokens: int = 0  # scheduled, not yet settled: what a window reserves beyond W - 1

    @property
    def num_blocks(self) -> int:
        return self.budget_bytes // self.spec.bytes_per_block

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def blocks_per_request(self) -> int:
        return self.spec.blocks_per_request(self.max_model_len, self.in_flight_tokens)

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    def concurrency_at(self, max_model_len: int) -> float:
        """Max concurrency these blocks would give requests of another length."""
        return self.num_blocks / self.spec.blocks_per_request(max_model_len, self.in_flight_tokens)

    @property
    def num_tokens(self) -> int:
        """vLLM's 'KV cache size' in tokens: concurrency × max_model_len."""
        return int(self.max_concurrency * self.max_model_len)

    def log_line(self) -> str:
        """The line vLLM logs at start-up, to match against an engine's log."""
        return (f"{self.device_label} KV cache size: {self.num_tokens:,} tokens, Maximum "
                f"concurrency for {self.max_model_len:,} tokens per request: "
                f"{self.max_concurrency:.2f}x")

    def summary(self) -> dict:
        return {**Bytes.of({"bytes_per_token": self.spec.bytes_per_token,
                            "bytes_per_block": self.spec.bytes_per_block,
                            "budget_bytes": self.budget_bytes}),
                **Count.of({"kv_cache_groups": len(self.spec.groups),
                            "blocks_per_request": self.blocks_per_request,
                            "num_blocks": self.num_blocks}),
                "cache_bytes": Bytes(self.cache_bytes), "num_tokens": Count(self.num_tokens),
                "max_concurrency": Ratio(self.max_concurrency), "log_line": self.log_line()}


def size_kv_cache(spec: KVCacheSpec, budget_bytes: int, max_model_len: int,
                  device_label: str = "GPU", in_flight_tokens: int = 0) -> KVCacheSizing:
    """Blocks for `budget_bytes`; refuses, as vLLM does, a cache that cannot hold one block or
    one request of max_model_len tokens, naming the largest max_model_len that would fit.
    vLLM keeps one block back (its block pool's null block) and checks each layer's
    reservation against the rest (vllm/v1/core/kv_cache_utils.py,
    `check_enough_kv_cache_memory`). `in_flight_tokens` (max_num_batched_tokens ×
    `concurrent_batches`) matters only to sliding windows."""
    if spec.windows and in_flight_tokens < 1:
        raise ValueError("a cache with sliding windows needs in_flight_tokens")
    sizing = KVCacheSizing(spec, budget_bytes, max_model_len, device_label, in_flight_tokens)
    usable = budget_bytes - spec.bytes_per_block
    if usable <= 0:
        raise ConfigError(
            f"the KV cache budget of {budget_bytes:,} bytes does not hold one block of "
            f"{spec.bytes_per_block:,} bytes beside vLLM's null block; raise "
            "gpu_memory_utilization, device_memory or kv_cache_memory_bytes, or lower block_size")
    if spec.request_bytes(max_model_len, in_flight_tokens) > usable:
        fits = largest_max_model_len(spec, usable, max_model_len, in_flight_tokens)
        raise ConfigError(
            f"max_model_len={max_model_len:,} needs {sizing.blocks_per_request:,} blocks plus "
            f"vLLM's null block but the KV cache holds {sizing.num_blocks:,} ({fits:,} usable "
            f"tokens); vLLM refuses to start here. Lower max_model_len to {fits:,} or less, or "
            "give the cache more memory")
    return sizing


def size_for_settings(settings, budget_bytes: int) -> KVCacheSizing:
    """`size_kv_cache` for a run's settings: its model, block size, cache dtype, TP,
    max_model_len, batched tokens and device."""
    return size_kv_cache(KVCacheSpec.from_settings(settings), budget_bytes,
                         settings.max_model_len, device_label(settings.device),
                         in_flight_tokens(settings))


def largest_max_model_len(spec: KVCacheSpec, usable_bytes: int, upper: int,
                          in_flight_tokens: int) -> int:
    """The longest request `usable_bytes` holds, by binary search as vLLM's
    `estimate_max_model_len` does (0 when not even one token fits)."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if spec.request_bytes(mid, in_flight_tokens) <= usable_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def kv_budget(settings, profile: str, profile_kv_cache_bytes: int | None) -> tuple[int, str]:
    """The KV budget and where it came from: `kv_cache_memory_bytes` when given (it overrides
    any profile, as vLLM's option of that name does), else what the memory profile named
    `profile` ("eager" or "compiled", chapter 01) left for the cache."""
    if settings.kv_cache_memory_bytes is not None:
        return settings.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if profile_kv_cache_bytes is None:
        raise ConfigError("no KV budget: give kv_cache_memory_bytes or a memory profile")
    return profile_kv_cache_bytes, f"the {profile} memory profile"


def torch_cache_dtype(spec: KVCacheSpec, model_dtype: str):
    import torch
    names = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}
    return names[model_dtype if spec.kv_cache_dtype == "auto" else spec.kv_cache_dtype]


def allocate(spec: KVCacheSpec, num_blocks: int, model_dtype: str, device: str):
    """One preallocated tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
    layer i's cache is the view `cache[i]` (K at [0], V at [1])."""
    import torch
    return torch.zeros(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads,
                       spec.head_dim, dtype=torch_cache_dtype(spec, model_dtype), device=device)


def allocate_shared(spec: KVCacheSpec, num_blocks: int, model_dtype: str, device: str):
    """The cache as vLLM allocates it: one [2, num_blocks, ...] slice per layer of the widest KV
    cache group (vLLM's `KVCacheTensor`s), each shared by one layer of every group. With one
    group (every layer alike) that is one slice per layer, as `allocate` makes."""
    import torch
    return torch.zeros(spec.group_size, 2, num_blocks, spec.block_size, spec.num_kv_heads,
                       spec.head_dim, dtype=torch_cache_dtype(spec, model_dtype), device=device)


def layer_views(cache, spec: KVCacheSpec | None = None) -> list:
    """Each layer's [2, num_blocks, block_size, num_kv_heads, head_dim] view of the one tensor:
    its own slice, or for a cache from `allocate_shared`, the slice its place in its group
    names (layer j of every group shares slice j)."""
    slices = cache.unbind(0)
    if spec is None:
        return list(slices)
    place = {layer: j for g in spec.groups for j, layer in enumerate(g.layers)}
    return [slices[place[i]] for i in range(spec.num_layers)]


def allocate_measured(spec: KVCacheSpec, num_blocks: int, model_dtype: str, device: str):
    """Allocate the cache as vLLM does (`allocate_shared`) and measure what it cost: (cache,
    bytes the allocation added)."""
    from kit.measure.memory import measure_allocations
    measured = measure_allocations(lambda: allocate_shared(spec, num_blocks, model_dtype, device),
                                   device, timeline=False)
    return measured.result, measured.left_bytes


def estimate_activation_bytes(arch, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """A rough eager peak for models the kit has not profiled: one layer's largest live set
    (residual and normed input, the MLP's gate, up and activated tensors) for every token, plus
    the logits of one token per sequence (model dtype and an fp32 copy for sampling)."""
    per_token = (2 * arch.hidden_size + 3 * arch.intermediate_size) * dtype_bytes
    return num_tokens * per_token + num_seqs * arch.vocab_size * (dtype_bytes + 4)


@dataclass(frozen=True)
class BudgetSplit:
    """How one rank's memory splits: weights, activations, KV cache, and what is held back."""

    capacity_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    sizing: KVCacheSizing

    @property
    def budget_bytes(self) -> int:
        return memory_budget(self.capacity_bytes, self.gpu_memory_utilization)

    @property
    def reserved_bytes(self) -> int:
        return self.capacity_bytes - self.budget_bytes

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weights_bytes - self.activation_bytes


def split_budget(arch, model_dtype: str, capacity_bytes: int, gpu_memory_utilization: float,
                 activation_bytes: int, block_size: int, kv_cache_dtype: str,
                 max_model_len: int, tensor_parallel_size: int = 1,
                 device_label: str = "GPU", in_flight_tokens: int = 2048,
                 device: str | None = None) -> BudgetSplit:
    """The calculator's arithmetic for one rank. Weights are split evenly over the ranks (vLLM
    shards the linear layers and the embedding; the small norms are replicated).
    `in_flight_tokens` (see `in_flight_tokens`) sizes sliding windows' reservations."""
    weights = arch.num_parameters() * DTYPE_BYTES[model_dtype] // tensor_parallel_size
    budget = memory_budget(capacity_bytes, gpu_memory_utilization)
    spec = KVCacheSpec.for_model(arch, block_size, model_dtype, kv_cache_dtype,
                                 tensor_parallel_size, device)
    kv = max(0, budget - weights - activation_bytes)
    return BudgetSplit(capacity_bytes, gpu_memory_utilization, weights, activation_bytes,
                       KVCacheSizing(spec, kv, max_model_len, device_label, in_flight_tokens))
