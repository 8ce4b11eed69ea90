"""The checkpoint names and shapes of a recurrent layer's tensors (`kit.engine.checkpoint`'s
`tensors_of` places them in a model): a Mamba-2 mixer (Granite-4.0-H, Nemotron-H) and a gated
delta-net (Qwen3-Next, Qwen3.5), as transformers writes them and vLLM loads them. Plain data:
each kit parameter -> the (name, shape) of the tensors stacked along dim 0 to make it.
"""
from __future__ import annotations

from kit.config import ModelConfig


def mamba2_tensors(arch: ModelConfig, kit: str, hf: str) -> dict:
    """A Mamba-2 mixer (`kit.engine.layers.mamba2`), under transformers' and vLLM's names."""
    rec, h = arch.recurrent, arch.hidden_size
    conv_dim = rec.inner + 2 * rec.groups * rec.state_dim
    shapes = {"in_proj.weight": (rec.inner + conv_dim + rec.heads, h),
              "conv1d.weight": (conv_dim, 1, rec.conv_kernel), "dt_bias": (rec.heads,),
              "A_log": (rec.heads,), "D": (rec.heads,), "norm.weight": (rec.inner,),
              "out_proj.weight": (h, rec.inner)}
    if rec.conv_bias:
        shapes["conv1d.bias"] = (conv_dim,)
    if rec.proj_bias:
        shapes.update({"in_proj.bias": (rec.inner + conv_dim + rec.heads,),
                       "out_proj.bias": (h,)})
    return {f"{kit}{name}": [(f"{hf}{name}", shape)] for name, shape in shapes.items()}


def gated_delta_tensors(arch: ModelConfig, kit: str, hf: str) -> dict:
    """A gated delta-net (`kit.engine.layers.gated_delta`) under transformers' and vLLM's
    names (Qwen3.5's four projections stacked into Qwen3-Next's two); the kit's `conv1d` is
    the stored convolution's weight."""
    rec, h = arch.recurrent, arch.hidden_size
    keys, values = rec.groups * rec.state_dim, rec.inner
    shapes = {"in_proj_qkvz.weight": (2 * keys + 2 * values, h),
              "in_proj_ba.weight": (2 * rec.heads, h), "dt_bias": (rec.heads,),
              "A_log": (rec.heads,), "norm.weight": (rec.head_dim,),
              "out_proj.weight": (h, values)}
    parts = {f"{kit}{name}": [(f"{hf}{name}", shape)] for name, shape in shapes.items()}
    if arch.parts.delta_projections == "apart":  # stacked as vLLM's Qwen3_5Model loads them
        apart = {"qkvz": {"qkv": 2 * keys + values, "z": values},
                 "ba": {"b": rec.heads, "a": rec.heads}}
        parts.update({f"{kit}in_proj_{fused}.weight": [(f"{hf}in_proj_{n}.weight", (rows, h))
                      for n, rows in each.items()] for fused, each in apart.items()})
    parts[f"{kit}conv1d"] = [(f"{hf}conv1d.weight", (2 * keys + values, 1, rec.conv_kernel))]
    return parts
