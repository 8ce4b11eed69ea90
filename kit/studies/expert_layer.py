"""One MoE layer's decode step alone (`python -m kit bench experts`): the same routed batch
through each way the kit can multiply its experts, and through vLLM's CPU fused MoE where
vLLM is installed, timed interleaved, with the bytes the picked experts hold and the rate
each streams them at.

    kernel     `kit::expert_products` (what a CPU decode step runs)
    grouped    a product per picked expert (`kit::grouped_mm`, what a prefill runs)
    gathered   Inductor's generated loop over the picked experts (compiled; what a GPU's
               compiled decode step runs)
    vllm       vLLM 0.32's `cpu_fused_moe` on its prepacked weights (SiLU experts only,
               `kit.vllm.fused_moe`)

Every way's output is checked against the kernel's: a fast way that multiplies wrong fails.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from kit.config import ModelConfig, TOLERANCE
from kit.engine.layers.experts import distinct_experts, one_moe_layer
from kit.measure.timing import interleaved_timings, per_round_best
from kit.vllm.fused_moe import vllm_fused_moe


@dataclass
class ExpertLayer:
    """What `time_expert_layer` measured: per way, each round's quickest call (seconds) and
    its output's largest difference from the kernel's, relative to the kernel's largest."""

    model: str
    dtype: str
    batch: int
    experts_read: int
    bytes_read: int
    seconds: dict[str, list[float]] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def median_ms(self, way: str) -> float:
        """The median over rounds of each round's quickest call, in ms."""
        return statistics.median(self.seconds[way]) * 1e3

    def rows(self) -> list[dict]:
        kernel = self.median_ms("kernel")
        return [{"way": way, "ms": round(self.median_ms(way), 2),
                 "GB/s": round(self.bytes_read / self.median_ms(way) / 1e6, 1),
                 "÷ kernel": round(self.median_ms(way) / kernel, 2),
                 "error vs kernel": f"{self.error[way]:.1e}"} for way in self.seconds]


def time_expert_layer(arch: ModelConfig, dtype: str, batch: int, rounds: int = 7,
                      calls: int = 10, seed: int = 0) -> ExpertLayer:
    """One MoE layer of `arch` (random weights), `batch` tokens routed by its router, each way
    timed `calls` times a round for `rounds` interleaved rounds (the expert kernel must have
    built here: `bench experts` says so before any work)."""
    moe = one_moe_layer(arch, dtype, seed).requires_grad_(False)
    ex = moe.experts
    x = torch.randn(batch, arch.hidden_size, dtype=getattr(torch, dtype))
    weights, ids = moe.route(x)
    per_expert = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) \
        * ex.gate_up_proj.element_size()
    picked = distinct_experts(ids)
    layer = ExpertLayer(arch.name, dtype, batch, picked, picked * per_expert)
    ways = {"kernel": lambda: ex(x, weights, ids)}
    ways["grouped"] = without_kernel(ex, lambda: ex(x, weights, ids))
    compiled = torch.compile(ex, dynamic=False)
    ways["gathered"] = without_kernel(ex, lambda: compiled(x, weights, ids))
    fused, why = vllm_fused_moe(moe, x, weights, ids)
    if fused is None:
        layer.skipped["vllm"] = why
    else:
        ways["vllm"] = fused
    reference = ways["kernel"]().float()
    for way, fn in ways.items():
        layer.error[way] = ((fn().float() - reference).abs().max() / reference.abs().max()).item()
    rounds_by_way = interleaved_timings(ways, "cpu", rounds, calls)
    layer.seconds = {way: per_round_best(r).seconds for way, r in rounds_by_way.items()}
    return layer


def without_kernel(experts, fn):
    """`fn` run with the expert kernel turned off for `experts` (their other ways)."""
    def run():
        experts.kernel_built = False
        try:
            return fn()
        finally:
            experts.kernel_built = True
    return run


def outside_tolerance(layer: ExpertLayer) -> list[str]:
    """The ways whose output left the dtype's tolerance of the kernel's."""
    return [w for w, e in layer.error.items() if e > TOLERANCE[layer.dtype]]
