"""The products with the weights (chapters 01, 03–05; the matmul dtype, chapter 04).

Every product with a weight goes through `linear`, plain `F.linear` but in compiled code after
`Decoder.multiply_in(torch.float32)`: then 16-bit weights are multiplied in float32, for CPUs
whose oneDNN has no 16-bit kernels; and after `Decoder.stream_products(True)`, set for a CPU
decode step of at most FEW_ROWS rows, float32 weights are multiplied in the expert kernel
(`kit.engine.layers.expert_kernel.weight_products`), each weight row read once for all the rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.engine.layers.expert_kernel import library, weight_products

# A decode step's rows up to which its float32 products run in the expert kernel on the CPU. A
# frozen product (Inductor's oneDNN, the batch a symbol) of 4 and 8 rows took 1.2-1.5x the
# kernel's time on a 2-core AVX2 EPYC (5120 x 2048 and 16384 x 2048 weights); at 16 rows they
# tied, and beyond the kernel's one weight row per output row at a time is the slower.
FEW_ROWS = 8
# The weights it takes: large enough that reading them bounds the product, beside the kernel's
# cost per call (a Python op), and rows long enough that a task's sums outweigh its overhead.
# tiny's (256 wide, its logits' 32,000 x 256) ran 1.3x slower in the kernel, so it keeps oneDNN.
STREAMED_BYTES, STREAMED_ROW = 16 << 20, 1024


def streams(weight: torch.Tensor, on: bool) -> bool:
    """Whether `weight`'s compiled products run in the kernel when a runner asks (`on`): float32
    on the CPU, of STREAMED_BYTES and rows of STREAMED_ROW numbers or more, where the kernel
    built (`Decoder.stream_products`)."""
    return on and weight.dtype == torch.float32 and weight.device.type == "cpu" and \
        weight.numel() * 4 >= STREAMED_BYTES and weight.shape[-1] >= STREAMED_ROW and \
        library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, matmul_dtype=None,
           few_rows: bool = False) -> torch.Tensor:
    """`F.linear`; in code being compiled with `matmul_dtype` given (`Decoder.multiply_in`),
    the product runs in that dtype and the result comes back in x's. With frozen weights the
    conversion folds into the constants, done once (eager code never converts: it would copy
    every weight on every call). In code being compiled with `few_rows` (`streams`), the
    product runs in the expert kernel."""
    if not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if few_rows:
        return weight_products(x, weight, bias)
    if matmul_dtype is None or matmul_dtype == weight.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(matmul_dtype), weight.to(matmul_dtype),
                    None if bias is None else bias.to(matmul_dtype)).to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` through `linear`: compiled, its product may run in `matmul_dtype`."""

    matmul_dtype: torch.dtype | None = None
    few_rows: bool = False  # compiled, its product runs in the expert kernel (`streams`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.matmul_dtype, self.few_rows)
