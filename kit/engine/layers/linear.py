"""The products with the weights (chapters 01, 03–05; the matmul dtype, chapter 04).

Every product with a weight goes through `linear`, plain `F.linear` but in compiled code after
`Decoder.multiply_in(torch.float32)`: then 16-bit weights are multiplied in float32, for CPUs
whose oneDNN has no 16-bit kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, matmul_dtype=None) -> torch.Tensor:
    """`F.linear`; in code being compiled with `matmul_dtype` given (`Decoder.multiply_in`),
    the product runs in that dtype and the result comes back in x's. With frozen weights the
    conversion folds into the constants, done once (eager code never converts: it would copy
    every weight on every call)."""
    if matmul_dtype is None or matmul_dtype == weight.dtype or not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return F.linear(x.to(matmul_dtype), weight.to(matmul_dtype),
                    None if bias is None else bias.to(matmul_dtype)).to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` through `linear`: compiled, its product may run in `matmul_dtype`."""

    matmul_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.matmul_dtype)
