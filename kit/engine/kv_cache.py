"""The KV cache of a run (chapters 02-05), shaped as vLLM 0.32's: a spec per layer
(`kit.engine.kv_specs`), the groups they make (`kit.engine.kv_groups`), their blocks, and,
once a budget is known, one `KVCacheConfig`: num_blocks, the tensors and which layers share
each, tokens and max concurrency, vLLM's start-up line. Built once per run and handed down: the
decode engine's block tables and cache, each attention layer's group and slice, the bytes a
step moves and chapter 05's comparison with vLLM all read it.

The arithmetic is vLLM's, written once here and shown in the notebooks:

    page            = one layer's block (`KVCacheSpec.page_size_bytes`; for attention
                      2 × num_kv_heads per rank × head_dim × cache dtype bytes × block_size)
    bytes per block = page × layers in the widest KV cache group (all layers when they all
                      attend alike)
    num_blocks      = floor(KV budget / bytes per block)
    max concurrency = num_blocks / Σ over groups of the blocks one request reserves

With tensor parallelism each rank holds max(1, num_kv_heads // tp) heads: heads are replicated
when there are fewer KV heads than ranks, as vLLM does. The budget is `kit.engine.budget`'s.
Only the allocation needs torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kit.config import DTYPE_BYTES, KV_CACHE_DTYPES, check_kv_cache_dtype, check_tensor_parallel
from kit.engine.hybrid_cache import BackendTraits, align_hybrid, latent_spec, state_spec
from kit.engine.kv_groups import KVCacheGroup, kv_cache_groups
from kit.engine.kv_specs import (AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec,
                                 attention_spec, unify_page_sizes)
from kit.errors import ConfigError
from kit.units import Bytes, Count, Ratio

CPU_KERNEL_BLOCK = 32  # vLLM's CPU attention takes blocks in multiples of this


def device_label(device: str) -> str:
    """How vLLM names the device in its log lines ("GPU" for CUDA, else "CPU", ...)."""
    return "GPU" if device == "cuda" else device.upper()


def in_flight_tokens(settings) -> int:
    """Tokens scheduled but not yet settled, which a sliding window keeps beside its W - 1:
    max_num_batched_tokens per step in flight, two steps with async scheduling (vLLM's default
    on CUDA), one on the CPU where vLLM turns it off (`VllmConfig.max_in_flight_tokens`)."""
    return settings.max_num_batched_tokens * (2 if settings.device == "cuda" else 1)


def cache_block_size(block_size: int, has_windows: bool, device: str | None) -> int:
    """The block vLLM gives a layer: `block_size`, except on the CPU for sliding windows
    (`has_windows`), which take the CPU kernel's blocks (multiples of 32:
    `_largest_kernel_block_within` in vLLM's `Attention.get_kv_cache_spec`); where the full
    layers' pages are then smaller, vLLM scales their blocks up to match
    (`unify_page_sizes`), so a model whose layers all have the same heads runs at that block
    (block_size 16 runs as 32), and Gemma 4's wider full layers keep theirs."""
    if device == "cpu" and has_windows and block_size % CPU_KERNEL_BLOCK:
        return -(-block_size // CPU_KERNEL_BLOCK) * CPU_KERNEL_BLOCK
    return block_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    return max(1, num_kv_heads // tensor_parallel_size)


def layer_spec(arch, layer: int, block_size: int, model_dtype: str, dtype_bytes: int,
               tensor_parallel_size: int, device: str | None, traits: BackendTraits,
               prefix_caching: bool = True) -> KVCacheSpec:
    """Layer `layer`'s spec: a recurrent state, a latent, or keys and values per head over
    its window, chunk or every position (`kit.engine.kv_specs`, `kit.engine.hybrid_cache`)."""
    if arch.is_recurrent(layer):
        return state_spec(arch, block_size, model_dtype, tensor_parallel_size,
                          traits, prefix_caching)
    if arch.latent_size:
        return latent_spec(arch, block_size, dtype_bytes, traits)
    window = arch.window(layer)
    return attention_spec(window, cache_block_size(block_size, window, device),
                          kv_heads_per_rank(arch.layer_kv_heads(layer), tensor_parallel_size),
                          arch.layer_head_dim(layer), dtype_bytes, arch.chunk(layer))


@dataclass(frozen=True)
class KVCacheLayout:
    """One rank's KV cache before its size is known: a spec per layer, grouped as vLLM groups
    them (each group's tokens per block its spec's: one page size), in one cache dtype."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int            # what the cache is sized at: the groups' smallest block
    requested_block_size: int  # the settings' block_size
    cache_dtype: str           # the elements' dtype: the model's for kv_cache_dtype "auto"
    kv_cache_dtype: str = "auto"
    # (layer, the layer whose cache it reads) for layers with no cache of their own (Gemma 4's
    # KV-shared layers: vLLM gives them no spec, so they cost no bytes)
    shared: tuple[tuple[int, int], ...] = ()
    # what vLLM logs as it sizes this layout (a hybrid's enlarged block and padded states)
    notes: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, arch, block_size: int, model_dtype: str, kv_cache_dtype: str = "auto",
                  tensor_parallel_size: int = 1, device: str | None = None,
                  prefix_caching: bool = True) -> "KVCacheLayout":
        """`arch`'s layers at `block_size`; `device` "cpu": at the blocks vLLM's CPU attention
        takes (`cache_block_size`). Each layer with a cache of its own gets a spec
        (`layer_spec`: its window, KV heads and head size, or its latent, or its recurrent
        state), a hybrid's block raised until a page holds a state (`align_hybrid`), their
        pages made one size as vLLM makes them (`unify_page_sizes`); a layer reading another's
        cache, or without a mixer, gets none. `prefix_caching` (vLLM's default, on) keeps a
        recurrent layer's states as its `mamba_cache_mode` "align" does."""
        check_tensor_parallel(arch, tensor_parallel_size)
        check_kv_cache_dtype(kv_cache_dtype)
        n, traits = arch.num_hidden_layers, BackendTraits.for_device(device)
        layers = tuple(i for i in range(n) if arch.has_kv_cache(i))
        cache_dtype = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        dtype_bytes = KV_CACHE_DTYPES[kv_cache_dtype] or DTYPE_BYTES[model_dtype]
        specs, notes = align_hybrid(tuple(
            layer_spec(arch, i, block_size, model_dtype, dtype_bytes, tensor_parallel_size,
                       device, traits, prefix_caching) for i in layers), block_size, traits)
        specs = unify_page_sizes(specs)
        shared = tuple((i, arch.kv_source(i)) for i in range(n) if arch.kv_source(i) != i)
        return cls(kv_cache_groups(specs, layers), min(s.block_size for s in specs),
                   block_size, cache_dtype, kv_cache_dtype, shared, notes)

    @classmethod
    def for_settings(cls, settings, prefix_caching: bool = True) -> "KVCacheLayout":
        """The run's layout: its model, block size, cache dtype, TP and device (`for_model`)."""
        return cls.for_model(settings.arch, settings.block_size, settings.dtype,
                             settings.kv_cache_dtype, settings.tensor_parallel_size,
                             settings.device, prefix_caching)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        """Each layer's spec, by layer index (layers reading another's cache have none)."""
        by_layer = {i: g.spec for g in self.groups for i in g.layers}
        return tuple(by_layer[i] for i in sorted(by_layer))

    @property
    def num_layers(self) -> int:
        """The model's layers: those with a cache and those reading another's."""
        return sum(len(g.layers) for g in self.groups) + len(self.shared)

    @property
    def has_windows(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def forgets(self) -> bool:
        """Whether a group hands back blocks before its sequence ends (windows, chunks)."""
        return any(g.window is not None or g.chunk is not None for g in self.groups)

    @property
    def group_size(self) -> int:
        """Layers in the widest group: the number of cache tensors, and pages per block id."""
        return max(len(g.layers) for g in self.groups)

    @property
    def page_size_bytes(self) -> int:
        """One layer's block; every group's is the same (vLLM unifies them)."""
        pages = {g.spec.page_size_bytes for g in self.groups}
        if len(pages) != 1:
            raise ValueError(f"the groups' pages differ ({sorted(pages)}): not one pool")
        return pages.pop()

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in each layer of the widest group."""
        return self.group_size * self.page_size_bytes

    @property
    def bytes_per_token(self) -> int:
        """One token's keys and values in every layer."""
        return sum(s.bytes_per_token for s in self.specs)

    def place(self, layer: int) -> tuple[int, int]:
        """(`layer`'s group, its place in the group): the block table it reads, and the
        tensor that holds its pages (layer j of every group shares tensor j); a layer reading
        another's cache reads that layer's."""
        layer = dict(self.shared).get(layer, layer)
        group = next(i for i, g in enumerate(self.groups) if layer in g.layers)
        return group, self.groups[group].layers.index(layer)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """Block ids one request of max_model_len tokens reserves, over all groups."""
        return sum(g.blocks_per_request(max_model_len, in_flight_tokens) for g in self.groups)

    def request_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        """The bytes vLLM checks one request against: the block ids it reserves over all
        groups, each costing bytes_per_block, so a group with fewer layers than the widest
        counts as full width (`_max_memory_usage_bytes_from_groups`)."""
        return self.bytes_per_block * self.blocks_per_request(max_model_len, in_flight_tokens)

    def block_size_note(self) -> str | None:
        """Why the cache's block differs from the settings' block_size; None where it does not."""
        if self.block_size == self.requested_block_size:
            return None
        why = (f"vLLM's CPU attention gives sliding-window layers blocks in multiples of "
               f"{CPU_KERNEL_BLOCK}, and sizes the whole cache at that block")
        if self.notes:
            why = ("vLLM raises a hybrid's attention block until one page holds a recurrent "
                   "layer's state, and pads the state to the page: " + " ".join(self.notes))
        elif self.latent:
            why = ("vLLM's reference CPU latent attention (for a CPU without AMX) takes blocks "
                   "of 16 tokens only")
        return f"block_size {self.requested_block_size} runs as {self.block_size}: {why}"

    def describe_blocks(self) -> str:
        """Each group's tokens per block and bytes per token, for messages."""
        return ", ".join(f"{g.spec.block_size}-token blocks of {g.spec.bytes_per_token} B per "
                         f"token (layers {list(g.layers)})" for g in self.groups)

    def formula(self) -> str:
        """The bytes-per-block arithmetic written out with this layout's numbers."""
        layers = f"{self.group_size} layers"
        if len(self.groups) > 1:
            layers += f" (the widest of {len(self.groups)} KV cache groups)"
        spec = next((g.spec for g in self.groups if isinstance(g.spec, AttentionSpec)),
                    self.groups[0].spec)
        page = spec.page_formula()
        if self.has_states:
            page += f" (a recurrent state padded to the same {self.page_size_bytes:,} B)"
        return f"{layers} × {page} = {self.bytes_per_block:,} B per block"

    @property
    def latent(self) -> bool:
        """Whether the layers keep a latent per token (MLA), not K and V per head."""
        return isinstance(self.attention_groups[0].spec, MLAAttentionSpec)

    @property
    def attention_groups(self) -> tuple[KVCacheGroup, ...]:
        """The groups whose pages hold tokens (a hybrid's recurrent groups' pages hold a
        state each: `kit.engine.hybrid_pages`)."""
        return tuple(g for g in self.groups if not isinstance(g.spec, MambaSpec))

    @property
    def has_states(self) -> bool:
        """Whether some layers keep a recurrent state per request (a hybrid)."""
        return any(isinstance(g.spec, MambaSpec) for g in self.groups)

    @property
    def row_spec(self) -> KVCacheSpec:
        """The attention spec of fewest bytes per token (largest block; the first on a tie):
        one of its tokens is one row of the cache (`tensor_shape`)."""
        return min((g.spec for g in self.attention_groups), key=lambda s: s.bytes_per_token)

    def decode_refusal(self) -> str | None:
        """Why the kit's paged decode cannot run this cache, or None: it writes a token of a
        layer with r times the narrowest layers' bytes as r rows of the cache (`tensor_shape`),
        so r must be whole and each page exactly its block's tokens (vLLM pads the rest)."""
        row = self.row_spec.bytes_per_token
        if all(g.spec.bytes_per_token % row == 0 and g.spec.page_size_bytes ==
               g.spec.block_size * g.spec.bytes_per_token for g in self.attention_groups):
            return None
        return (f"the kit's paged decode needs every layer's bytes per token a whole multiple "
                f"of the narrowest's, unpadded pages; these groups have {self.describe_blocks()}"
                ". Sizing, the cache and its block tables are exact; to decode, choose heads "
                "whose bytes per token are multiples of the narrowest layers'")

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The cache as one tensor: [group size, 2 (K and V), num_blocks, block_size,
        num_kv_heads, head_dim]; tensor j is vLLM's `KVCacheTensor` j (a hybrid's is a view of
        pages that hold its recurrent states too: `kit.engine.hybrid_pages`). Latent attention keeps
        one latent per token and no K/V pair: [group size, num_blocks, block_size,
        kv_lora_rank + qk_rope_head_dim], as vLLM's MLA backends view their tensor. Its rows
        are `row_spec`'s; layers of other heads (Gemma 4's full layers) use the same bytes per
        page in their own shape, r rows a token (`kit.engine.layers.attention.write_kv`)."""
        spec = self.row_spec
        if self.latent:
            return (self.group_size, num_blocks, spec.block_size, spec.head_size)
        return (self.group_size, 2, num_blocks, spec.block_size, spec.num_kv_heads,
                spec.head_size)

    @property
    def decode_block_sizes(self) -> tuple[int, ...] | None:
        """Each group's tokens per block where the attention groups' differ, else None (a
        decode step takes the cache's); a recurrent group, whose slot is its table's column 0
        (`kit.engine.layers.state_slots`), gets the cache's."""
        attention = self.attention_groups
        if len({g.spec.block_size for g in attention}) == 1:
            return None
        return tuple(g.spec.block_size if g in attention else self.block_size
                     for g in self.groups)


@dataclass(frozen=True)
class KVCacheConfig:
    """The run's KV cache at a budget (vLLM's `KVCacheConfig`): how many blocks it buys, and
    what that means in tokens and requests."""

    layout: KVCacheLayout
    budget_bytes: int
    max_model_len: int
    device_label: str = "GPU"  # as vLLM's log line names the device (`device_label`)
    in_flight_tokens: int = 0  # scheduled, not yet settled: what a window reserves beyond W - 1

    @property
    def num_blocks(self) -> int:
        return self.budget_bytes // self.layout.bytes_per_block

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def tensors(self) -> list[tuple[int, tuple[int, ...]]]:
        """vLLM's `KVCacheTensor`s: (bytes, the layers sharing it), one per place in a group."""
        size = self.num_blocks * self.layout.page_size_bytes
        return [(size, tuple(g.layers[j] for g in self.layout.groups if j < len(g.layers)))
                for j in range(self.layout.group_size)]

    @property
    def blocks_per_request(self) -> int:
        return self.layout.blocks_per_request(self.max_model_len, self.in_flight_tokens)

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    def concurrency_at(self, max_model_len: int) -> float:
        """Max concurrency these blocks would give requests of another length."""
        return self.num_blocks / self.layout.blocks_per_request(max_model_len,
                                                                self.in_flight_tokens)

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
        return {**Bytes.of({"bytes_per_token": self.layout.bytes_per_token,
                            "bytes_per_block": self.layout.bytes_per_block,
                            "budget_bytes": self.budget_bytes}),
                **Count.of({"kv_cache_groups": len(self.layout.groups),
                            "blocks_per_request": self.blocks_per_request,
                            "num_blocks": self.num_blocks}),
                "cache_bytes": Bytes(self.cache_bytes), "num_tokens": Count(self.num_tokens),
                "max_concurrency": Ratio(self.max_concurrency), "log_line": self.log_line()}


def kv_cache_config(layout: KVCacheLayout, budget_bytes: int, max_model_len: int,
                    device_label: str = "GPU", in_flight_tokens: int = 0) -> KVCacheConfig:
    """Blocks for `budget_bytes`; refuses, as vLLM does, a cache that cannot hold one block or
    one request of max_model_len tokens, naming the largest max_model_len that would fit.
    vLLM keeps one block back (its block pool's null block) and checks each layer's
    reservation against the rest (vllm/v1/core/kv_cache_utils.py,
    `check_enough_kv_cache_memory`). `in_flight_tokens` (max_num_batched_tokens ×
    `concurrent_batches`) matters only to sliding windows."""
    config = KVCacheConfig(layout, budget_bytes, max_model_len, device_label, in_flight_tokens)
    usable = budget_bytes - layout.bytes_per_block
    if usable <= 0:
        raise ConfigError(
            f"the KV cache budget of {budget_bytes:,} bytes does not hold one block of "
            f"{layout.bytes_per_block:,} bytes beside vLLM's null block; raise "
            "gpu_memory_utilization, device_memory or kv_cache_memory_bytes, or lower block_size")
    if layout.request_bytes(max_model_len, in_flight_tokens) > usable:
        fits = largest_max_model_len(layout, usable, max_model_len, in_flight_tokens)
        raise ConfigError(
            f"max_model_len={max_model_len:,} needs {config.blocks_per_request:,} blocks plus "
            f"vLLM's null block but the KV cache holds {config.num_blocks:,} ({fits:,} usable "
            f"tokens); vLLM refuses to start here. Lower max_model_len to {fits:,} or less, or "
            "give the cache more memory")
    return config


def config_for_settings(layout: KVCacheLayout, settings, budget_bytes: int) -> KVCacheConfig:
    """`kv_cache_config` at the settings' max_model_len, device and batched tokens; refused
    where vLLM would not start for want of recurrent states (`too_few_states`)."""
    config = kv_cache_config(layout, budget_bytes, settings.max_model_len,
                             device_label(settings.device), in_flight_tokens(settings))
    refusal = too_few_states(config, settings.max_num_seqs, settings.device)
    if refusal:
        raise ConfigError(refusal)
    return config


def too_few_states(config: KVCacheConfig, max_num_seqs: int, device: str) -> str | None:
    """vLLM's refusal on a GPU, where it captures full CUDA graphs of the decode (its default
    for hybrids): every decode sequence needs a block of each recurrent group, so max_num_seqs
    must not exceed num_blocks (`CompilationConfig`, vLLM #49064); None where it starts."""
    if device != "cuda" or not config.layout.has_states or max_num_seqs <= config.num_blocks:
        return None
    return (f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks "
            f"({config.num_blocks:,}): each decode sequence needs one block of every recurrent "
            f"group, and vLLM refuses to start (#49064). Lower max_num_seqs to "
            f"{config.num_blocks:,} or less, or give the cache more memory")


def largest_max_model_len(layout: KVCacheLayout, usable_bytes: int, upper: int,
                          in_flight_tokens: int) -> int:
    """The longest request `usable_bytes` holds, by binary search as vLLM's
    `estimate_max_model_len` does (0 when not even one token fits)."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if layout.request_bytes(mid, in_flight_tokens) <= usable_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def torch_cache_dtype(layout: KVCacheLayout):
    import torch
    names = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}
    return names[layout.cache_dtype]


def allocate(layout: KVCacheLayout, num_blocks: int, device: str):
    """The cache as vLLM allocates it: one [2, num_blocks, ...] tensor per place in the widest
    KV cache group (vLLM's `KVCacheTensor`s), each shared by one layer of every group
    (`KVCacheLayout.tensor_shape`). With one group, that is one tensor per layer. A hybrid's
    is a view of one buffer of pages that holds its recurrent states too (`kit.engine.
    hybrid_pages`): the same shape, block-major, exactly num_blocks × page × places bytes."""
    import torch
    if layout.has_states:
        from kit.engine.hybrid_pages import allocate_pages
        return allocate_pages(layout, num_blocks, device, torch_cache_dtype(layout))
    return torch.zeros(layout.tensor_shape(num_blocks), dtype=torch_cache_dtype(layout),
                       device=device)


def layer_views(cache, layout: KVCacheLayout) -> list:
    """Each layer's [2, num_blocks, block_size, num_kv_heads, head_dim] view of the one
    tensor (latent attention's: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]):
    the slice its place in its group names (layer j of every group shares slice j)."""
    return [cache[layout.place(i)[1]] for i in range(layout.num_layers)]


def cache_blocks(cache) -> tuple[int, int]:
    """(num_blocks, block_size) of a cache tensor of either shape (`tensor_shape`): a
    latent cache has 4 dimensions, K and V per head 6."""
    return (cache.shape[1], cache.shape[2]) if cache.dim() == 4 else \
        (cache.shape[2], cache.shape[3])


def allocate_measured(layout: KVCacheLayout, num_blocks: int, device: str):
    """Allocate the cache (`allocate`) and measure what it cost: (cache, bytes the allocation
    added)."""
    from kit.measure.memory import measure_allocations
    measured = measure_allocations(lambda: allocate(layout, num_blocks, device), device,
                                   timeline=False)
    return measured.result, measured.left_bytes
