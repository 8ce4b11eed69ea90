"""Chapter 01, memory profiling as vLLM does it (`kit.engine.profile_run`: the profile run,
eager and compiled): what each profile leaves the KV cache, in blocks, and the compiled
profile against the eager one beside the numbers of vLLM #7796.
"""
from __future__ import annotations

from dataclasses import dataclass

from kit.config import ModelConfig, reference
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.profile_run import MemoryProfile
from kit.units import Bytes, Count, Fraction, Ratio, parse_bytes


def blocks_left(layout: KVCacheLayout, profiles: dict[str, "MemoryProfile"]) -> dict:
    """The KV cache each profile leaves, in blocks of the run's cache (`layout`; chapter 02's
    unit: vLLM's num_gpu_blocks); none when a profile leaves nothing."""
    per_block = layout.bytes_per_block
    return {**{name: Count(max(0, p.kv_cache_bytes) // per_block)
               for name, p in profiles.items()},
            "block_size": Count(layout.block_size), "bytes_per_block": Bytes(per_block)}


@dataclass
class VersusPR:
    """The compiled profile against the eager one, as ratios, beside the PR's.

    What the compiled profile gains is the eager profile's extra activations, so
    KV compiled ÷ KV eager = 1 + extra ÷ KV eager: the lesson shows on a device as tight as the
    PR's, where the eager profile's extra activations are a sizeable share of the cache it
    leaves (the PR: 8800 of 25752 blocks), and vanishes on a roomy one."""

    kv_ratio: float             # KV cache bytes, compiled ÷ eager
    activation_ratio: float     # peak activations, compiled ÷ eager
    pr_kv_ratio: float          # the PR's KV blocks, compiled ÷ eager (Gemma-2B on a GPU)
    pr_blocks: tuple[int, int]  # the PR's (compiled, eager) blocks
    extra_bytes: int            # the eager peak's activations beyond the compiled one's
    eager_kv_bytes: int         # what the eager profile leaves the KV cache
    weights_share: float        # weights ÷ the device's capacity, here
    pr_weights_share: float     # Gemma-2B's bf16 weights ÷ the 16 GiB its numbers fit

    @property
    def extra_over_eager_kv(self) -> float:
        return self.extra_bytes / self.eager_kv_bytes

    @property
    def pr_extra_over_eager_kv(self) -> float:
        compiled, eager = self.pr_blocks
        return (compiled - eager) / eager

    def summary(self) -> dict:
        return {**Ratio.of({"kv_ratio_compiled_over_eager": self.kv_ratio,
                            "activation_ratio_compiled_over_eager": self.activation_ratio,
                            "pr_kv_ratio": self.pr_kv_ratio,
                            "eager_extra_over_eager_kv": self.extra_over_eager_kv,
                            "pr_eager_extra_over_eager_kv": self.pr_extra_over_eager_kv}),
                "eager_extra_activation_bytes": Bytes(self.extra_bytes),
                **Fraction.of({"weights_share_of_capacity": self.weights_share,
                               "pr_weights_share_of_capacity": self.pr_weights_share})}


def versus_pr(profiles: dict[str, MemoryProfile]) -> VersusPR:
    pr = reference("pr7796")
    eager, compiled = profiles["eager"], profiles["compiled"]
    blocks = (pr["kv_blocks_profile_compiled"], pr["kv_blocks_profile_eager"])
    return VersusPR(compiled.kv_cache_bytes / eager.kv_cache_bytes,
                      compiled.peak_activation_bytes / eager.peak_activation_bytes,
                      blocks[0] / blocks[1], blocks,
                      eager.peak_activation_bytes - compiled.peak_activation_bytes,
                      eager.kv_cache_bytes, eager.weights_bytes / eager.capacity_bytes,
                      ModelConfig.load(pr["model"]).num_parameters() * 2
                      / parse_bytes(pr["device_memory_assumed"]))
