"""The products with the weights (chapters 01, 03–05; the matmul dtype, chapter 04).

Every product with a weight goes through `linear`, plain `F.linear` but in compiled code after
`Decoder.multiply_in(torch.float32)`: then 16-bit weights are multiplied in float32, for CPUs
whose oneDNN has no 16-bit kernels; and after `Decoder.stream_products(rows)`, set for a CPU
decode step of at most FEW_ROWS rows, a large float32 weight is multiplied in the expert kernel
(`kit.engine.layers.expert_kernel.weight_products`, each weight row read once for all the rows)
where that was measured quicker than oneDNN on this CPU (`kit.engine.layers.product_choice`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.engine.layers.expert_kernel import library, weight_products
from kit.engine.layers.product_choice import measured_choice

# A decode step's rows up to which its float32 products may run in the expert kernel on the
# CPU, where measured quicker (`product_choice`): at 16 rows the kernel and a frozen oneDNN
# product tied on a 2-core AVX2 EPYC, and beyond, the kernel's few rows a tile are the slower.
FEW_ROWS = 8
# The weights it takes: large enough that reading them bounds the product, beside the kernel's
# cost per call (a Python op), and rows long enough that a task's sums outweigh its overhead.
# tiny's (256 wide, its logits' 32,000 x 256) ran 1.3x slower in the kernel, so it keeps oneDNN.
STREAMED_BYTES, STREAMED_ROW = 16 << 20, 1024


def streams(weight: torch.Tensor, rows: int) -> bool:
    """Whether `weight`'s compiled products run in the kernel in a step of `rows` rows (0: a
    runner that does not ask, `Decoder.stream_products`): float32 on the CPU, of STREAMED_BYTES
    and rows of STREAMED_ROW numbers or more, at most FEW_ROWS rows, where the kernel built and
    was measured quicker than oneDNN at this shape and rows (`product_choice`)."""
    return 0 < rows <= FEW_ROWS and weight.dtype == torch.float32 and \
        weight.device.type == "cpu" and weight.numel() * 4 >= STREAMED_BYTES and \
        weight.shape[-1] >= STREAMED_ROW and library() is not None and \
        measured_choice(*weight.shape, rows).kernel


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
