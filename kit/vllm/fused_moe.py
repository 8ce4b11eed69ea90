"""vLLM's CPU fused MoE (`cpu_fused_moe`, on weights `cpu_prepack_moe_weight` prepacked) run on
one of the kit's MoE layers, for `python -m kit bench experts` to time beside the kit's ways.
vLLM 0.32 gives it SiLU-gated experts without biases ("amx" tiles for bf16, "vec" for
float32); vLLM is imported only when it is called."""
from __future__ import annotations

import torch

from kit.vllm.installed import vllm_missing


def vllm_fused_moe(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """(a call running vLLM's fused MoE on `moe`'s experts for x routed to `ids` with
    `weights`, None) with the weights prepacked once, or (None, why it cannot run here)."""
    ex = moe.experts
    if ex.gelu or ex.clamped or ex.gate_up_proj_bias is not None or ex.scale_input:
        return None, "vLLM's fused MoE here takes SiLU-gated experts without biases"
    missing = vllm_missing()
    if missing:
        return None, missing
    from vllm import _custom_ops as ops
    isa = "amx" if x.dtype == torch.bfloat16 else "vec"
    try:
        w13 = ops.cpu_prepack_moe_weight(ex.gate_up_proj.detach(), isa)
        w2 = ops.cpu_prepack_moe_weight(ex.down_proj.detach(), isa)
    except (AttributeError, RuntimeError) as e:  # a vLLM build without the CPU kernels
        return None, f"no vLLM CPU fused MoE here ({type(e).__name__}: {e})"
    out, ids32 = torch.empty_like(x), ids.to(torch.int32)

    def run():
        ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids32, "silu", isa)
        return out
    return run, None
