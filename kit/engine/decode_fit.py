"""Does a decode run fit in the KV cache (chapters 04, 05; `python -m kit bench decode`)? Checked
before anything heavy: the request itself (`check_request`), then the run's blocks in the run's
KV cache layout against its budget (`fit_in_cache`, `early_fit`): kv_cache_memory_bytes, else
what chapter 01's eager memory profile leaves (`decode_budget`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kit.config import Settings
from kit.engine.budget import kv_budget, weights_budget
from kit.engine.decode import check_capacity, prompt_lengths
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.profile_run import profile_run, recorded_eager_kv_bytes
from kit.engine.model import Decoder, weights_bytes
from kit.errors import ConfigError
from kit.measure.device import capacity_bytes
from kit.units import Bytes, Count, GiB


@dataclass
class CacheFit:
    """What a decode run will hold in the KV cache, and the budget it must fit in."""

    prompt_lens: list[int]
    steps: int
    block_size: int
    blocks_needed: int
    budget_bytes: int
    budget_source: str
    budget_blocks: int

    def summary(self) -> dict:
        return {**Count.of(self.__dict__), "budget_bytes": Bytes(self.budget_bytes)}


def check_request(settings: Settings, layout: KVCacheLayout) -> None:
    """Refuse what the paged decode cannot run in the run's KV cache (`layout`), with what to
    change."""
    if settings.output_len < 2:
        raise ConfigError(f"output_len={settings.output_len}: the prefill makes the first token, "
                          "so timing decode steps needs output_len of 2 or more")
    if settings.tensor_parallel_size != 1:
        raise ConfigError(f"tensor_parallel_size={settings.tensor_parallel_size}: the kit's "
                          "decode runs on one device; use 1")
    if layout.cache_dtype != settings.dtype:
        raise ConfigError(f"kv_cache_dtype={settings.kv_cache_dtype!r}: the kit's decode stores "
                          f"keys and values in the model's dtype ({settings.dtype}); use 'auto'")


def fit_in_cache(settings: Settings, layout: KVCacheLayout, budget_bytes: int,
                 budget_source: str) -> CacheFit:
    """The run's blocks in its KV cache (`layout`) against `budget_bytes`; refuses, naming the
    missing blocks, when the tokens do not fit."""
    lengths = prompt_lengths(settings.batch_size, settings.input_len)
    steps = settings.output_len - 1
    budget_blocks = max(0, budget_bytes) // layout.bytes_per_block
    need = check_capacity(layout, lengths, steps, budget_blocks,
                          f"{budget_source} ({budget_bytes / GiB:,.2f} GiB)")
    return CacheFit(lengths, steps, layout.block_size, need, budget_bytes, budget_source,
                    budget_blocks)


def early_fit(settings: Settings, layout: KVCacheLayout) -> CacheFit:
    """Before loading anything: the request checked (`check_request`), then the exact fit when
    kv_cache_memory_bytes is given, else one against the most the cache could ever get
    (capacity × utilization − weights)."""
    check_request(settings, layout)
    if settings.kv_cache_memory_bytes is not None:
        return fit_in_cache(settings, layout, settings.kv_cache_memory_bytes,
                            "kv_cache_memory_bytes")
    most = weights_budget(settings.arch, settings.dtype,
                          capacity_bytes(settings.device, settings.device_memory),
                          settings.gpu_memory_utilization).kv_cache_bytes
    return fit_in_cache(settings, layout, most, "capacity × gpu_memory_utilization − weights")


def decode_budget(settings: Settings, model: Decoder, recorded: dict | None = None,
                  before=None) -> tuple[int, str]:
    """`kv_budget` with chapter 01's eager profile of `model`: read from chapter 01's record
    (`recorded`) when it holds one for the same settings, else measured now (only when no
    kv_cache_memory_bytes is given). `before` is `cuda_usage()` taken before `model` was built
    (CUDA), so that a profile measured now subtracts the memory grown outside PyTorch, as
    chapter 01's does; None on the CPU."""
    left = None
    if settings.kv_cache_memory_bytes is None:
        left = recorded_eager_kv_bytes(settings, recorded)
        if left is None:
            with torch.inference_mode():
                left = profile_run(model, settings, "eager", weights_bytes(model),
                                   before).kv_cache_bytes
    return kv_budget(settings, "eager", left)
