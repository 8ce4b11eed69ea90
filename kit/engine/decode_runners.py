"""Building the decode runs' runners (chapters 04, 05): the decode step's runner for a strategy
(`decode_runner`), the CPU's compiled prefill (`prefill_runner`, shared by every compiled
strategy through `SharedPrefill`), and a throw-away run that warms a strategy up (`warm_up`).
Which dtype compiled code multiplies in, and which dimensions it keeps symbolic, is decided
here, per device (docs/measurements.md, "Decode steps", gives the rates behind each choice).
"""
from __future__ import annotations

import time

import torch

from kit.engine.decode import PagedBatch, prefill_function, step_for
from kit.engine.expert_picks import moe_layers
from kit.engine.model import Decoder
from kit.engine.runners import CompiledGraphs, Runner, make_runner
from kit.measure.device import onednn_has_kernels, synchronize

# On the CPU, compiled strategies freeze the weights: Inductor treats them as constants and
# prepacks them for oneDNN, as vLLM's CPU backend prepacks its linear layers (faster at a
# decode batch; docs/measurements.md, "Decode steps", gives the rates seen). The frozen copy
# costs one more copy of the weights while the runner lives.
CPU_FREEZING = {"freezing": True}
# In float32 Inductor packs for oneDNN only when the batch is a symbol; with a fixed batch it
# hands the weights to MKL's packed GEMM, which streamed a decode step's weights at a quarter of
# oneDNN's rate on the AMD CPUs measured (docs/measurements.md, "Decode steps"). So on the CPU,
# where the products run in float32, the step's batch dimension is marked dynamic: input_ids,
# positions, block_tables ([groups, seqs, width]).
CPU_FLOAT32_DYNAMIC = {0: (0,), 1: (0,), 2: (1,)}
# The compiled prefill (CPU) serves every group of equal-length prompts: the number of prompts
# and their length are symbols (input_ids' dimensions 0 and 1, slot_mapping's 1: [groups,
# tokens]).
PREFILL_DYNAMIC = {0: (0, 1), 1: (1,)}


def compiled_matmul_dtype(model: Decoder, device: str) -> torch.dtype | None:
    """The dtype the compiled runners multiply the weights in (`Decoder.multiply_in`): float32
    for 16-bit weights on a CPU whose oneDNN has no kernels for them (`onednn_has_kernels`),
    where a 16-bit product is emulated; None (the weights' own) everywhere else."""
    dtype = next(model.parameters()).dtype
    if device == "cpu" and dtype != torch.float32 and not onednn_has_kernels(dtype):
        return torch.float32
    return None


def cpu_inductor_config(model: Decoder, matmul_dtype: torch.dtype | None) -> dict:
    """Inductor's settings for the CPU's compiled runners: the weights frozen (CPU_FREEZING),
    and eager's casts emulated where a model routes through experts and its 16-bit weights are
    multiplied in float32 (`matmul_dtype`). `linear` rounds such a product back to the
    activations' dtype, as eager code rounds every op's result, but Inductor drops a downcast
    that a fused op reads back unless told to emulate eager's casts, so the run keeps in
    float32 what the eager no-cache reference rounds. A dense model's logits carry that only
    as rounding (tiny's stay within bf16's tolerance, its step 3% quicker without the casts);
    a router turns it into other experts: a gpt-oss-20b-like bf16 run (batch 8, 128-token
    prompts, AVX2) was 3.5e-2 from its reference at the prefill (tolerance 4e-2), its routers
    picking other experts than the reference's across gaps of up to 7.5e-2 of their logits;
    with the casts 1.3e-2 and 1.8e-2, the step as quick (docs/experts.md,
    "Compiled code rounds as eager code does")."""
    casts = matmul_dtype is not None and bool(moe_layers(model))
    return {**CPU_FREEZING, **({"emulate_precision_casts": True} if casts else {})}


@torch.no_grad()
def decode_runner(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor],
                  strategy: str, prefill=None, shared: CompiledGraphs | None = None) -> Runner:
    """`strategy`'s runner of the decode step, built (compiled, or its CUDA graph captured) by
    running the first step of a fresh run of `batch` (prefilled through `prefill`, eagerly by
    default), which is left ready for its second step.
    Shapes are fixed by the batch (nothing marked dynamic) but on the CPU when the products run
    in float32 (CPU_FLOAT32_DYNAMIC); a CUDA graph is captured for exactly this batch size, on
    the batch's own tensors, so no padded row ever writes. On the CPU, compiled strategies
    freeze the weights, in float32 where 16-bit products are emulated
    (`compiled_matmul_dtype`), a model with experts then rounding as eager code does
    (`cpu_inductor_config`); a step of at most `linear.FEW_ROWS` sequences multiplies its large
    float32 weights in the expert kernel where that was measured quicker on this CPU
    (`Decoder.stream_products`). `shared`: the step's compiled
    graph, kept for the other strategies on this model and batch (`CompiledGraphs`)."""
    device = batch.kv_cache.device.type
    matmul_dtype = compiled_matmul_dtype(model, device)
    model.multiply_in(matmul_dtype)
    float32 = (matmul_dtype or next(model.parameters()).dtype) == torch.float32
    on_cpu = device == "cpu"
    model.stream_products(len(prompts) if on_cpu else 0)
    batch.start(model, prompts, prefill)
    batch.make_room()
    runner = make_runner(step_for(model, batch), strategy, device,
                         batch.step_args(),
                         dynamic_dims=CPU_FLOAT32_DYNAMIC if on_cpu and float32 else {},
                         capture_sizes=[len(prompts)],
                         inductor_config=cpu_inductor_config(model, matmul_dtype) if on_cpu
                         else None, shared=shared)
    batch.positions.add_(1)  # the runner's first call was the step at these positions
    return runner


@torch.no_grad()
def prefill_runner(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor]) -> Runner | None:
    """The prefill compiled for the CPU (None elsewhere: it stays eager), guard-free with the
    prompts' number and length dynamic (PREFILL_DYNAMIC) and the weights frozen, as the decode
    step's are: one graph serves every group of equal-length prompts. Built on the batch's
    first group, written at any slots (a run's `start` resets the cache's bookkeeping), its
    layers bound to the batch's cache layout first (a compiled mode may run before any run)."""
    device = batch.kv_cache.device.type
    if device != "cpu":
        return None
    matmul_dtype = compiled_matmul_dtype(model, device)
    model.multiply_in(matmul_dtype)
    model.stream_products(0)  # (a decode runner may have set it on this model)
    model.bind_kv_cache(batch.layout)  # compiled before any run has bound it
    ids = torch.stack([p for p, n in zip(prompts, batch.lengths) if n == batch.lengths[0]])
    slots = torch.arange(ids.numel(), device=device).repeat(len(batch.groups), 1)
    return make_runner(prefill_function(model), "guard_free", device,
                       (ids.to(device), slots, batch.kv_cache, *batch.state_args),
                       dynamic_dims=PREFILL_DYNAMIC,
                       inductor_config=cpu_inductor_config(model, matmul_dtype))


class SharedPrefill:
    """The prefill every compiled strategy uses: on the CPU one compiled prefill
    (`prefill_runner`), built when the first of them asks and shared, since the strategies
    differ in how they run the step, not the prefill; eager elsewhere and for the eager
    strategy (None). `discard()` frees it."""

    def __init__(self, model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor],
                 progress=None):
        self.model, self.batch, self.prompts, self.progress = model, batch, prompts, progress
        self.runner = None

    def for_strategy(self, strategy: str):
        on_cpu = self.batch.kv_cache.device.type == "cpu"
        if strategy == "eager" or not on_cpu:
            return None
        if self.runner is None:
            self.say("compiling the prefill (shared by the compiled strategies) ...")
            self.runner = prefill_runner(self.model, self.batch, self.prompts)
            self.say(f"  {self.runner.compile_seconds:.2f} s")
        return self.runner

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def discard(self) -> None:
        if self.runner is not None:
            self.runner.discard()


@torch.no_grad()
def warm_up(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor], steps: int,
            strategy: str, prefill=None, warmup_steps: int = 2,
            shared: CompiledGraphs | None = None):
    """A throw-away run (prefilled through `prefill`, eagerly by default) that builds
    `strategy`'s runner of the step (compiling, taking the graph from `shared`, or capturing a
    CUDA graph) and runs a few steps; returns the runner and the run's seconds."""
    device = batch.kv_cache.device.type
    t0 = time.perf_counter()
    runner = decode_runner(model, batch, prompts, strategy, prefill, shared)
    for _ in range(min(warmup_steps, steps) - 1):  # stay within the table's width
        batch.step(runner)
    synchronize(device)
    return runner, time.perf_counter() - t0
