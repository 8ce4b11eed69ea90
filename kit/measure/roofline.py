"""The roofline of a decode step (chapter 04): what one step must move and compute, and the
floor that the device's measured bandwidth puts under its time.

A decode step feeds one new token per sequence. However it is implemented, it must

    read the weights once        every linear layer's matrix, the LM head included; of the input
                                 embedding only the rows of the batch's tokens (with tied
                                 embeddings the LM head is that same table, read once); of an
                                 MoE layer the router and only the distinct experts the batch's
                                 tokens picked (`experts_read`, recorded per step:
                                 `kit.engine.expert_picks`), every expert when not told
    read the cached context      for each sequence, the K and V of every token before the new one
    write the new K and V        one token per sequence, every layer
    write the logits             num_seqs × vocab_size

    floor (s) = bytes / measured copy bandwidth (bytes read + written per second)

and it computes 2 FLOPs per active weight per token for the matrix products (a token runs only
its k experts: `ModelConfig.linear_weights(active=True)`) plus 4 × heads × head_dim
per layer per attended token (scores and the weighted sum of values). The arithmetic here is
pure Python (the shapes come from `kit.config.ModelConfig`); the two measurements are
`kit.measure.throughput`'s probes, bounded in time.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from kit.config import ModelConfig
from kit.units import Bytes, BytesPerSecond, Count, Flop, FlopPerByte, FlopPerSecond, Seconds


@dataclass(frozen=True)
class StepCost:
    """Bytes one decode step must move and FLOPs it must compute."""

    num_seqs: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    logits_bytes: int
    flops: int
    experts_read: tuple[int, ...] = ()  # distinct experts read per MoE layer (empty: dense)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.logits_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved: far below a device's FLOPs/bandwidth ratio means memory-bound."""
        return self.flops / self.total_bytes

    def floor_seconds(self, bandwidth: float) -> float:
        return self.total_bytes / bandwidth

    def summary(self) -> dict:
        return {"num_seqs": Count(self.num_seqs),
                **Bytes.of({"weight_bytes": self.weight_bytes, "kv_read_bytes": self.kv_read_bytes,
                            "kv_write_bytes": self.kv_write_bytes,
                            "logits_bytes": self.logits_bytes, "total_bytes": self.total_bytes}),
                "flops": Flop(self.flops), "experts_read": Count.of(list(self.experts_read)),
                "arithmetic_intensity": FlopPerByte(self.arithmetic_intensity)}


def weight_bytes_per_step(arch: ModelConfig, dtype_bytes: int, num_seqs: int,
                          experts_read=None) -> int:
    """Every parameter once, except the embedding rows no token of the batch reads
    (`unread_embedding_rows`) and, in an MoE layer, the experts no token picked:
    `experts_read`, one count per MoE layer in layer order (None: every expert, the most a
    step can read)."""
    return (arch.num_parameters() - unread_expert_weights(arch, experts_read)
            - unread_embedding_rows(arch, num_seqs)) * dtype_bytes


def unread_embedding_rows(arch: ModelConfig, num_seqs: int) -> int:
    """Elements of the embedding tables a step of `num_seqs` tokens does not read: an untied
    input embedding is read only at the batch's rows, and so is Gemma 4's per-layer table; a
    tied table is read whole by the LM head and its batch's rows once more (negative)."""
    unread = (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size) \
        - num_seqs * arch.hidden_size
    if arch.hidden_size_per_layer_input:
        unread += (arch.vocab_size_per_layer_input - num_seqs) * arch.per_layer_width
    return unread


def embedding_rows_formula(arch: ModelConfig, num_seqs: int) -> str:
    """`unread_embedding_rows` written out: `(32,000 − 8) rows × 256`."""
    terms = [f"−{num_seqs} rows × {arch.hidden_size:,}" if arch.tie_word_embeddings
             else f"({arch.vocab_size:,} − {num_seqs}) rows × {arch.hidden_size:,}"]
    if arch.hidden_size_per_layer_input:
        terms.append(f"({arch.vocab_size_per_layer_input:,} − {num_seqs}) rows × "
                     f"{arch.per_layer_width:,}")
    return " + ".join(terms)


def weights_reconciled(arch: ModelConfig, cost: "StepCost", num_seqs: int,
                       dtype_bytes: int) -> tuple[int, str]:
    """The floor's weights (counted from the config) plus what a step of `num_seqs` tokens
    does not read, the embedding rows outside the batch and the experts no token picked:
    the total in bytes, which must be the built model's tensors, and the sum written out."""
    rows = unread_embedding_rows(arch, num_seqs)
    experts = unread_expert_weights(arch, cost.experts_read or None) * dtype_bytes
    total = cost.weight_bytes + rows * dtype_bytes + experts
    return total, (f"{cost.weight_bytes:,} B (the floor's) + embedding "
                   f"{embedding_rows_formula(arch, num_seqs)} = {rows:,} elements × "
                   f"{dtype_bytes} B" + (f" + {experts:,} B of experts no token picked"
                                         if experts else "") + f" = {total:,} B")


def unread_expert_weights(arch: ModelConfig, experts_read=None) -> int:
    """Elements of the experts no token of the step picked, over every MoE layer."""
    moe = [i for i in range(arch.num_hidden_layers) if arch.is_moe(i)]
    if experts_read is None:
        return 0
    if len(experts_read) != len(moe) or not all(0 < n <= arch.num_experts for n in experts_read):
        raise ValueError(f"experts_read needs one count in 1..{arch.num_experts} per MoE layer "
                         f"({len(moe)}), got {list(experts_read)}")
    return sum(arch.num_experts - n for n in experts_read) * arch.expert_elements()


def decode_step_cost(arch: ModelConfig, dtype_bytes: int, layer_specs,
                     context_lens: list[int], experts_read=None) -> StepCost:
    """The cost of one step in which sequence i's context is `context_lens[i]` tokens, its new
    token included. Each layer's KV cache spec (`layer_specs`, one per layer:
    `kit.engine.kv_specs`) says how many of them its attention reads (`tokens_read`: all for
    full attention, at most the last W for a window W, the new token among them, which is
    written rather than read) and what it stores per token (`bytes_per_token`). An MoE
    model's step reads the distinct experts `experts_read` (per MoE layer) its batch picked.
    Gemma 4's KV-shared layers have no spec (they write nothing) but read their source
    layer's cache again; its layers' head sizes differ by kind."""
    num_seqs = len(context_lens)
    readers = reading_specs(arch, layer_specs)
    attended = [sum(spec.tokens_read(n) for n in context_lens) for spec in readers]
    heads = [arch.layer_head_dim(i) for i in range(len(readers))] \
        if len(readers) == arch.num_hidden_layers else [arch.head_dim] * len(readers)
    return StepCost(
        num_seqs=num_seqs,
        weight_bytes=weight_bytes_per_step(arch, dtype_bytes, num_seqs, experts_read),
        kv_read_bytes=sum((a - num_seqs) * spec.bytes_per_token
                          for a, spec in zip(attended, readers)),
        kv_write_bytes=num_seqs * sum(spec.bytes_per_token for spec in layer_specs),
        logits_bytes=num_seqs * arch.vocab_size * dtype_bytes,
        flops=2 * num_seqs * arch.linear_weights(active=True)
        + 4 * arch.num_attention_heads * sum(d * a for d, a in zip(heads, attended)),
        experts_read=tuple(experts_read or ()))


def reading_specs(arch: ModelConfig, layer_specs) -> list:
    """The spec of the cache each layer reads: its own, or for a KV-shared layer its source
    layer's (`layer_specs` are those of the layers with a cache, in order)."""
    owners = [i for i in range(arch.num_hidden_layers) if arch.has_kv_cache(i)]
    if len(owners) != len(layer_specs) or len(owners) == arch.num_hidden_layers:
        return list(layer_specs)
    by_layer = dict(zip(owners, layer_specs))
    return [by_layer[arch.kv_source(i)] for i in range(arch.num_hidden_layers)]


def formula(cost: StepCost, bandwidth: float) -> str:
    """The floor written out with this step's numbers, for the notebook."""
    mb = 1e6
    return (f"({cost.weight_bytes / mb:,.2f} MB weights + {cost.kv_read_bytes / mb:,.2f} MB KV "
            f"read + {cost.kv_write_bytes / mb:,.3f} MB KV written + {cost.logits_bytes / mb:,.2f}"
            f" MB logits) / {bandwidth / 1e9:,.1f} GB/s = "
            f"{cost.floor_seconds(bandwidth) * 1e3:,.3f} ms")


@dataclass(frozen=True)
class DeviceLimits:
    """What this device sustains, measured in this run: copy bandwidth and matmul throughput."""

    device: str
    copy_bytes: int
    copy_seconds: float          # median of the first measurement's copies
    bandwidth: float             # bytes read + written per second (median of the samples)
    matmul_size: int
    matmul_dtype: str
    matmul_flops_per_second: float
    bandwidth_samples: tuple[float, ...]  # every copy measurement of the run, in order

    def with_samples(self, more) -> "DeviceLimits":
        """The copy measured again while the run went on (after each round of timed runs):
        `bandwidth` becomes the median of every measurement, so the floor reflects the whole
        run rather than its first second (on a shared machine a neighbour's memory traffic
        moves it)."""
        samples = (*self.bandwidth_samples, *more)
        return replace(self, bandwidth=statistics.median(samples), bandwidth_samples=samples)

    def summary(self) -> dict:
        rates = BytesPerSecond.of({"bandwidth": self.bandwidth,
                                   "bandwidth_min": min(self.bandwidth_samples),
                                   "bandwidth_max": max(self.bandwidth_samples),
                                   "bandwidth_samples": self.bandwidth_samples})
        return {**self.__dict__, "copy_bytes": Bytes(self.copy_bytes),
                "copy_seconds": Seconds(self.copy_seconds), "matmul_size": Count(self.matmul_size),
                "matmul_flops_per_second": FlopPerSecond(self.matmul_flops_per_second), **rates}


def measure_limits(device: str, dtype: str) -> DeviceLimits:
    """Both measurements (each bounded to about a second: `kit.measure.throughput`), taken in
    the same process as the decode timings they judge."""
    from kit.measure.throughput import copy_bandwidth, matmul_throughput
    copy, matmul = copy_bandwidth(device), matmul_throughput(device, dtype)
    return DeviceLimits(device=device, copy_bytes=copy.size, copy_seconds=copy.timings.median,
                        bandwidth=copy.rate, matmul_size=matmul.size, matmul_dtype=dtype,
                        matmul_flops_per_second=matmul.rate, bandwidth_samples=(copy.rate,))
