"""vLLM's CPU fused MoE (`cpu_fused_moe`, on weights `cpu_prepack_moe_weight` prepacked) run on
one of the kit's MoE layers, for `python -m kit bench experts` to time beside the kit's ways.
vLLM 0.32 gives it SiLU-gated experts without biases. Its ISA is the one vLLM's own MoE layer
would take on this CPU (`kit.vllm.cpu_kernels.moe_isa`: "amx" only where the CPU has AMX tiles,
"vec" on other x86 CPUs), and the kernel is first tried small in a child process (`TRIAL`): a
kernel that would end the process here is skipped with the reason instead. vLLM is imported
only when it is called."""
from __future__ import annotations

import functools
import hashlib

import torch

from kit.config.data import CACHE
from kit.engine.layers.expert_kernel import cpu_features
from kit.measure.in_child import try_in_child
from kit.vllm.cpu_kernels import moe_isa
from kit.vllm.installed import vllm_missing, vllm_version

# A child's trial of the fused MoE at one ISA and dtype (argv[1], argv[2]): two experts of 64
# by 64 (vLLM's CPU kernels want multiples of 32), four tokens, each routed to both.
TRIAL = """
import sys, torch
from vllm import _custom_ops as ops
isa, dtype = sys.argv[1], getattr(torch, sys.argv[2])
w13, w2 = torch.randn(2, 128, 64, dtype=dtype), torch.randn(2, 64, 64, dtype=dtype)
x, ids = torch.randn(4, 64, dtype=dtype), torch.tensor([[0, 1]] * 4, dtype=torch.int32)
out = torch.empty_like(x)
ops.cpu_fused_moe(out, x, ops.cpu_prepack_moe_weight(w13, isa),
                  ops.cpu_prepack_moe_weight(w2, isa), None, None,
                  torch.full((4, 2), 0.5), ids, "silu", isa)
assert out.isfinite().all()
"""


@functools.cache
def trial_failure(isa: str, dtype: str) -> str | None:
    """None where vLLM's fused MoE at `isa` ran a small product in a child process here (a
    success is remembered in the kit's cache, per vLLM version and CPU), else why it did not."""
    key = hashlib.sha256("\0".join([TRIAL, isa, dtype, str(vllm_version()), cpu_features()])
                         .encode()).hexdigest()[:16]
    passed = CACHE / "trials" / f"vllm-fused-moe-{key}"
    if passed.exists():
        return None
    failure = try_in_child(TRIAL, isa, dtype)
    if failure is None:
        passed.parent.mkdir(parents=True, exist_ok=True)
        passed.touch()
    return failure


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
    try:
        isa, refused = moe_isa(x.dtype, ex.down_proj.shape[1], ex.down_proj.shape[2],
                               ex.down_proj.shape[0])
    except (AttributeError, ImportError) as e:  # a vLLM build without the CPU kernels
        return None, f"no vLLM CPU fused MoE here ({type(e).__name__}: {e})"
    if isa is None:
        return None, refused
    failure = trial_failure(isa, str(x.dtype).removeprefix("torch."))
    if failure:
        return None, (f"vLLM's fused MoE ({isa!r} kernels) failed a trial in a child "
                      f"process: {failure}")
    w13 = ops.cpu_prepack_moe_weight(ex.gate_up_proj.detach(), isa)
    w2 = ops.cpu_prepack_moe_weight(ex.down_proj.detach(), isa)
    out, ids32 = torch.empty_like(x), ids.to(torch.int32)

    def run():
        ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids32, "silu", isa)
        return out
    return run, None
