"""Which way a CPU decode step multiplies a large float32 weight: Inductor's frozen oneDNN
product or the expert kernel (`kit.engine.layers.expert_kernel.weight_products`), measured on
the CPU the step runs on, once per weight shape, rows and threads (chapters 04, 05;
`kit.engine.layers.linear.streams` asks).

Why measured, not a rule: at a decode batch of 4 and 8 rows the kernel took 0.67-0.83x
oneDNN's time on a 2-core AVX2 EPYC (5120 x 2048 and 16384 x 2048 weights), but 1.08-1.28x on a
2-core AVX-512 EPYC (Zen 4), whose oneDNN product runs 512-bit FMAs over several rows; at one
row the kernel was the quicker on both (0.60-0.65x on the Zen 4). A rule written on one kind
was wrong on the other, so each run asks its own CPU.

How: the two ways as the compiled step calls them, eagerly, on a weight of the same shape
(random, so one measurement serves every weight of that shape): oneDNN's packed product
(`mkldnn._reorder_linear_weight` then `mkldnn._linear_pointwise`, what Inductor's freezing
emits for a float32 product whose batch is a symbol, `decode_runners.CPU_FLOAT32_DYNAMIC`) and
the kernel, CALLS calls each in each of ROUNDS interleaved rounds; the kernel runs the product
where its quickest call took at most KERNEL_MARGIN of oneDNN's: the library's own
product unless the kit's kernel earns its place (beside a busy test run the two often measured
level, 0.99-1.01, and a tie is no reason to leave oneDNN). The quickest, not the median: on a
2-core machine shared with other work a two-thread product waits whenever one of its threads
is descheduled (seen: both ways at 8.0 ms a call, whatever the shape, beside a test run), and
the quickest call is what each way does when it has the cores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kit.engine.layers.expert_kernel import weight_products
from kit.measure.timing import interleaved_timings

ROUNDS, CALLS = 9, 3
KERNEL_MARGIN = 0.95


@dataclass(frozen=True)
class ProductChoice:
    """One weight shape's measurement: each way's quickest call at `rows` rows, in seconds."""

    out_features: int
    in_features: int
    rows: int
    threads: int
    onednn_seconds: float
    kernel_seconds: float
    ratio: float  # kernel ÷ oneDNN

    @property
    def kernel(self) -> bool:
        return self.ratio <= KERNEL_MARGIN

    def summary(self) -> dict:
        return {"weight": [self.out_features, self.in_features], "rows": self.rows,
                "threads": self.threads, "onednn_seconds": self.onednn_seconds,
                "kernel_seconds": self.kernel_seconds, "kernel_over_onednn": self.ratio,
                "runs_in": "kernel" if self.kernel else "oneDNN"}


_MEASURED: dict[tuple[int, int, int, int], ProductChoice] = {}


def measured_choice(out_features: int, in_features: int, rows: int) -> ProductChoice:
    """The measurement for this shape at `rows` rows and the current torch threads: taken the
    first time it is asked for in this process, then kept."""
    key = (out_features, in_features, rows, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = measure(*key)
    return _MEASURED[key]


def measured_choices() -> list[ProductChoice]:
    """Every measurement this process took, in the order taken."""
    return list(_MEASURED.values())


@torch.no_grad()
def measure(out_features: int, in_features: int, rows: int, threads: int) -> ProductChoice:
    """Both ways at `rows` rows on a random weight [out_features, in_features], CALLS calls a
    round for ROUNDS interleaved rounds (`kit.measure.timing.interleaved_timings`); each way's
    quickest call."""
    weight = torch.empty(out_features, in_features).uniform_(-0.05, 0.05)
    x = torch.empty(rows, in_features).uniform_(-1.0, 1.0)
    ways = {"oneDNN": library_product(x, weight, rows),
            "kernel": lambda: weight_products(x, weight)}
    rounds = interleaved_timings(ways, "cpu", ROUNDS, CALLS)
    onednn, kernel = (min(min(r.seconds) for r in rounds[way]) for way in ways)
    return ProductChoice(out_features, in_features, rows, threads, onednn, kernel,
                         kernel / onednn)


def library_product(x: torch.Tensor, weight: torch.Tensor, rows: int):
    """The library's product as Inductor's frozen graph calls it: oneDNN's on a weight packed
    for `rows` rows, or, where this PyTorch has no oneDNN, plain `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return lambda: torch.nn.functional.linear(x, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
