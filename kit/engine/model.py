"""A decoder assembled from its parts (kit/engine/layers) as the family's description says
(`kit.config.FAMILIES`), with random weights drawn from a seed or a checkpoint's (chapters 01,
03–05).

`forward` runs prefill over a batch of equal-length sequences (as vLLM's profiling run does)
and returns hidden states; `compute_logits` is applied to one position per sequence, as an
engine's sampler does. `decode` runs one token per sequence over the paged KV cache (chapter
04), its layers bound to the run's KV cache layout (`Decoder.bind_kv_cache`).
`Decoder.multiply_in` sets the dtype compiled code multiplies the weights in
(`kit.engine.layers.linear`). Per layer, the attention's window and RoPE base follow the
config (`ModelConfig.window`, `layer_rope_theta`); Gemma 2 caps the final logits. A layer's
MLP is dense or a mixture of experts (`ModelConfig.is_moe`, `kit.engine.layers.experts`).
"""
from __future__ import annotations

import torch
from torch import nn

from kit.config import ModelConfig
from kit.engine.huge_pages import on_huge_pages
from kit.engine.layers.attention import Attention, AttentionMetadata
from kit.engine.layers.linear import Linear, linear, streams
from kit.engine.layers.mamba2 import Mamba2Mixer
from kit.engine.layers.experts import Experts, SparseMoE
from kit.engine.layers.gated_delta import GatedDeltaNet, HeadGatedNorm
from kit.engine.layers.gemma4_moe import Gemma4MoE
from kit.engine.layers.mla import LatentAttention
from kit.engine.layers.mla_moe import DeepSeekMoE
from kit.engine.layers.mlp import MLP, Relu2MLP
from kit.engine.layers.norm import NORMS, RMSNorm
from kit.engine.layers.per_layer_inputs import PerLayerGate, PerLayerInputs
from kit.engine.layers.rotary import rope_cos_sin
from kit.engine.layers.prefill_attention import soft_cap
from kit.engine.layers.gated_attention import GatedAttention
from kit.engine.layers.shared_gate_moe import SharedGateMoE
from kit.measure.device import torch_dtype


def make_norm(arch: ModelConfig) -> RMSNorm:
    """A norm over the hidden state, of the family's kind."""
    return NORMS[arch.parts.norm](arch.hidden_size, arch.rms_norm_eps)


class DecoderLayer(nn.Module):
    """Pre-norm ("pre_norm" in `kit.config.LAYER_NORMS`): attention and the MLP each read the
    residual stream through a norm and add their output to it."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = make_norm(arch)
        # DeepSeek's latent attention and its experts with shared ones (kit.engine.layers.mla);
        # a hybrid's recurrent layers mix tokens with Mamba-2 or a gated delta-net in
        # attention's place; Qwen3-Next's attention and shared expert are gated
        # (kit.engine.layers.gated_delta, gated_attention, shared_gate_moe)
        latent = bool(arch.latent_size)
        recurrent = GatedDeltaNet if arch.recurrent and arch.recurrent.kind == "gated_delta_net" \
            else Mamba2Mixer
        mixer = recurrent if arch.is_recurrent(layer_idx) else LatentAttention if latent \
            else GatedAttention if arch.attn_output_gate else Attention
        self.self_attn = mixer(arch, layer_idx)
        # Granite: each sub-layer's output scaled before it joins the residual stream
        self.residual_multiplier = arch.hybrid.residual_multiplier if arch.hybrid else 1.0
        self.post_attention_layernorm = make_norm(arch)
        moe = arch.is_moe(layer_idx) and not arch.parts.gemma4  # (Gemma 4's: `Gemma4Layer`)
        experts = DeepSeekMoE if latent else \
            SharedGateMoE if arch.parts.shared_expert_gate else SparseMoE
        self.mlp = experts(arch, layer_idx) if moe else MLP(arch, layer_idx)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                extra=None):
        x = x + self.scaled(self.self_attn(self.input_layernorm(x), cos, sin, num_seqs, meta))
        return x + self.scaled(self.mlp(self.post_attention_layernorm(x)))

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class SandwichLayer(DecoderLayer):
    """Gemma 2 and 3 ("sandwich" in `kit.config.LAYER_NORMS`): attention and the MLP each read
    the residual stream through a norm, and their outputs are normed again before they are
    added to it."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        self.pre_feedforward_layernorm = make_norm(arch)
        self.post_feedforward_layernorm = make_norm(arch)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                extra=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, num_seqs, meta)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4Layer(SandwichLayer):
    """Gemma 4's layer: Gemma 3's sandwich, attention handed the forward's keys and values for
    the KV-shared layers (`extra`: (the handed-on dict, [tokens, layers, p] per-layer inputs
    or None)), its per-layer input added (`PerLayerGate`), and the sum scaled by the layer's
    stored `layer_scalar` (a buffer in transformers and vLLM, 1 unless trained otherwise)."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        self.layer_idx = layer_idx
        self.per_layer = PerLayerGate(arch) if arch.hidden_size_per_layer_input else None
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = None
        if arch.is_moe(layer_idx):  # experts beside the dense MLP, each output normed
            self.moe = Gemma4MoE(arch, layer_idx)
            self.pre_feedforward_layernorm_2 = make_norm(arch)
            self.post_feedforward_layernorm_1 = make_norm(arch)
            self.post_feedforward_layernorm_2 = make_norm(arch)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                extra=None):
        handed_on, per_layer_inputs = extra
        attn = self.self_attn(self.input_layernorm(x), cos, sin, num_seqs, meta, handed_on)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(
                self.moe(x, self.pre_feedforward_layernorm_2(x)))
        x = x + self.post_feedforward_layernorm(mlp)
        if self.per_layer is not None:
            x = x + self.per_layer(x, per_layer_inputs[:, self.layer_idx])
        return x * self.layer_scalar


class MixerLayer(nn.Module):
    """Nemotron-H's block: one norm, then one mixer (Mamba-2, attention) or an MLP alone
    (`ModelConfig.attention_kind` MLP_ONLY: relu², no cache), its output added to the residual
    stream (transformers' `NemotronHBlock`)."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.norm = make_norm(arch)
        if arch.has_kv_cache(layer_idx):
            self.self_attn = (Mamba2Mixer if arch.is_recurrent(layer_idx) else Attention)(
                arch, layer_idx)
        else:
            self.mlp = Relu2MLP(arch, arch.hybrid.mlp_bias)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                extra=None):
        if hasattr(self, "self_attn"):
            return x + self.self_attn(self.norm(x), cos, sin, num_seqs, meta)
        return x + self.mlp(self.norm(x))


# Where a layer's norms sit (`Parts.layer`) -> the layer that places them so.
LAYERS = {"pre_norm": DecoderLayer, "sandwich": SandwichLayer, "mixer": MixerLayer}


class Decoder(nn.Module):
    """The whole model. Build it with `build_model`, which places and initializes the weights."""

    matmul_dtype: torch.dtype | None = None  # compiled code's products (`multiply_in`)
    few_rows: bool = False  # compiled, the logits' product in the expert kernel (`stream_products`)

    def __init__(self, arch: ModelConfig):
        super().__init__()
        self.arch, self.parts = arch, arch.parts
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        layer = Gemma4Layer if self.parts.gemma4 else LAYERS[self.parts.layer]
        self.layers = nn.ModuleList(layer(arch, i) for i in range(arch.num_hidden_layers))
        self.per_layer_inputs = PerLayerInputs(arch) if arch.hidden_size_per_layer_input \
            else None
        self.norm = make_norm(arch)
        self.lm_head = None if arch.tie_word_embeddings else \
            Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.parts.scale_embeddings:  # by sqrt(hidden_size) rounded to the model dtype, as
            # transformers and vLLM round it (Gemma)
            x = x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)
        if self.arch.hybrid and self.arch.hybrid.embedding_multiplier != 1.0:  # Granite
            x = x * self.arch.hybrid.embedding_multiplier
        return x

    def forward(self, input_ids: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Prefill. input_ids: [num_seqs, seq_len] -> hidden states [num_seqs, seq_len, hidden].
        With `meta` (its slot_mapping covering every token), the keys and values also go to
        the paged cache."""
        num_seqs, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device).repeat(num_seqs)
        hidden = self.run_layers(input_ids.reshape(-1), positions, num_seqs, meta)
        return hidden.view(num_seqs, seq_len, -1)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """One decode step: one new token per sequence at `positions` ([num_seqs] each), its
        attention reading the context through `meta`'s block tables -> [num_seqs, hidden]."""
        return self.run_layers(input_ids, positions, input_ids.shape[0], meta)

    def run_layers(self, input_ids, positions, num_seqs: int, meta=None) -> torch.Tensor:
        """Flat tokens [tokens] at `positions` [tokens] through every layer and the final norm."""
        rope = self.rope_tables(positions)
        x = self.embed(input_ids)
        extra = None  # Gemma 4: the keys and values handed on, and the per-layer inputs
        if self.parts.gemma4:
            extra = ({}, None if self.per_layer_inputs is None
                     else self.per_layer_inputs(input_ids, x))
        for i, layer in enumerate(self.layers):
            x = layer(x, *rope[self.rope_of(i)], num_seqs, meta, extra)
        return self.norm(x)

    def rope_of(self, layer: int) -> tuple:
        """Layer `layer`'s RoPE: its head size, base and scaling (Llama 3's, YaRN's, Gemma 4's
        proportional; on full layers only when the sliding ones have their own base, as Gemma
        3's and 4's local RoPE is unscaled); () for a layer without RoPE (Llama 4's NoPE
        layers). Latent attention turns only its qk_rope_head_dim rotary elements, Qwen3-Next
        the first partial_rotary_factor of each head."""
        if not self.arch.uses_rope(layer):
            return ()
        own_base = self.arch.rope_local_base_freq and self.arch.window(layer)
        dim = self.arch.qk_rope_head_dim or \
            int(self.arch.layer_head_dim(layer) * self.arch.partial_rotary_factor)
        return (dim, self.arch.layer_rope_theta(layer),
                () if own_base else self.arch.rope_scaling)

    def rope_tables(self, positions: torch.Tensor) -> dict:
        """cos and sin at `positions` for each distinct RoPE among the layers (one or two);
        for layers without RoPE, each token's query scale and None (`query_temperature`)."""
        kinds = {self.rope_of(i) for i in range(len(self.layers))}
        return {kind: rope_cos_sin(positions, *kind) if kind
                else (self.query_temperature(positions), None) for kind in kinds}

    def query_temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Llama 4's temperature tuning of its NoPE layers' queries, [tokens] float32:
        1 + attn_scale · ln(1 + floor((position + 1) / floor_scale)) (transformers'
        `Llama4TextAttention`, vLLM's `_get_attn_scale`); None where the config turns it off."""
        if self.arch.floor_scale is None:
            return None
        floor = torch.floor((positions.float() + 1.0) / self.arch.floor_scale)
        return torch.log1p(floor) * self.arch.attn_scale + 1.0

    @property
    def logits_weight(self) -> nn.Parameter:
        """The LM head's weight: the embedding table itself where the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.logits_weight, matmul_dtype=self.matmul_dtype,
                        few_rows=self.few_rows)
        if self.arch.hybrid and self.arch.hybrid.logits_scaling != 1.0:  # Granite
            logits = logits / self.arch.hybrid.logits_scaling
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)

    def bind_kv_cache(self, layout) -> None:
        """Give every attention layer its KV cache group and cache slice from the run's layout
        (`kit.engine.kv_cache.KVCacheLayout`), and every recurrent layer its group and place
        (`kit.engine.layers.state_slots`), as vLLM's runner binds each layer to its cache;
        the layout must be this model's (its layers without a mixer have no cache)."""
        mixers = [layer.self_attn for layer in self.layers if hasattr(layer, "self_attn")]
        if layout.num_layers != len(mixers):
            raise ValueError(f"a layout of {layout.num_layers} layers for a model of "
                             f"{len(mixers)} with a cache")
        for mixer in mixers:
            mixer.bind_kv_cache(layout)

    def multiply_in(self, dtype: torch.dtype | None) -> None:
        """Compiled code runs every product with the weights in `dtype` (None: the weights'
        own). On a CPU whose oneDNN has no bf16 kernels (x86 without AVX-512), a bf16 product
        is emulated several times slower than a float32 one: there the decode runners
        multiply 16-bit weights in float32 (`kit.engine.decode_runners.compiled_matmul_dtype`); the
        products of 16-bit numbers are exact in float32, so only the result's rounding to
        the model's dtype remains, as in a native 16-bit product. Eager code is unchanged."""
        self.matmul_dtype = dtype
        for module in self.modules():
            if isinstance(module, (Linear, Experts)):  # the experts: `Experts.one_kernel`
                module.matmul_dtype = dtype

    def stream_products(self, rows: int) -> None:
        """Compiled code multiplies each large float32 CPU weight (`streams`: every `Linear`'s
        and the logits') in the expert kernel where, in a decode step of `rows` rows (the decode
        runner sets it; 0, the prefill's, clears it), the kernel was measured quicker than
        Inductor's frozen oneDNN product on this CPU (`kit.engine.layers.product_choice`), each
        weight row read from memory once for all the step's rows. Eager code is unchanged."""
        self.few_rows = streams(self.logits_weight, rows)
        for module in self.modules():
            if isinstance(module, Linear):
                module.few_rows = streams(module.weight, rows)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Random weights from `seed`, the same on every run of the same device; each norm at the
    scale that leaves its input as normalized, biases at zero. Gemma 4 does not divide its
    scores by sqrt(head_dim) (its trained q_norm carries the scale), so its q_norm starts at
    head_dim^-1/2: at 1, scores of normed heads spread over ±sqrt(head_dim) and a bf16 step
    moved the logits by 0.07-0.24 from float32's (tiny-gemma4), against tiny's 0.01."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, b in model.named_buffers():  # Gemma 4's layer_scalar: 1
        if name.endswith("layer_scalar"):
            b.fill_(1.0)
    for name, p in sorted(model.named_parameters()):
        owner = model.get_submodule(name.rpartition(".")[0])
        delta_net = isinstance(owner, GatedDeltaNet)
        if delta_net and name.endswith(("A_log", "dt_bias")):  # its decay: A = 1, dt_bias = 1
            p.fill_(1.0 if name.endswith("dt_bias") else 0.0)
        elif delta_net and name.endswith("conv1d"):  # taps at a scale that passes x on
            p.normal_(0.0, 0.5, generator=gen)
        elif isinstance(owner, (RMSNorm, HeadGatedNorm)):
            owner.reset_parameters()
            if name.endswith("q_norm.weight") and model.arch.parts.unscaled_scores:
                p.mul_(p.shape[0] ** -0.5)  # Gemma 4's scores are unscaled: its q_norm scales
        elif name.endswith(("moe.scale", "per_expert_scale")):  # Gemma 4's router: 1
            p.fill_(1.0)
        elif name.endswith("bias"):  # ".bias", and the experts' "_bias"
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


# Parameters kept in float32 whatever the model's dtype: DeepSeek-V3's routing bias, added to
# scores in (0, 1) to choose experts (transformers' `_keep_in_fp32_modules_strict`; vLLM's
# `DeepseekV2MoE` makes it a float32 parameter)
FLOAT32_PARAMETERS = ("e_score_correction_bias",)


def keep_float32(model: nn.Module) -> nn.Module:
    """`model` with its `FLOAT32_PARAMETERS` back in float32 (on its device, before weights)."""
    for name, p in list(model.named_parameters()):
        if name.endswith(FLOAT32_PARAMETERS) and p.dtype != torch.float32:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(p.float(), p.requires_grad))
    return model


def build_model(arch: ModelConfig, dtype: str, device: str, seed: int = 0) -> Decoder:
    """Allocate the weights directly on `device` in `dtype` (no fp32 copy; a CPU's large ones
    on huge pages, `kit.engine.huge_pages`), then draw them from `seed`, or read them from
    `arch.checkpoint` when the model is a checkpoint folder."""
    if arch.checkpoint:  # a bad folder is refused before the weights are allocated
        from kit.engine.checkpoint import check_checkpoint, load_checkpoint
        check_checkpoint(arch)
    with torch.device("meta"):
        model = keep_float32(Decoder(arch).to(torch_dtype(dtype)))
    model = model.to_empty(device=device)
    on_huge_pages(model)  # the CPU's large weights (empty still, so nothing is copied)
    if arch.checkpoint:
        load_checkpoint(model, arch)
    else:
        init_weights(model, seed)
    return model.eval().requires_grad_(False)


def weights_bytes(model: nn.Module) -> int:
    """Parameter bytes, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dummy_batch(num_tokens: int, max_num_seqs: int, vocab_size: int, device: str, seed: int = 0):
    """Token ids [num_seqs, seq_len] holding exactly `num_tokens` tokens, in as many equal
    sequences as possible up to `max_num_seqs` (vLLM's profiling run also splits its tokens
    over up to max_num_seqs requests)."""
    num_seqs = max(d for d in range(1, min(max_num_seqs, num_tokens) + 1) if num_tokens % d == 0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_seqs, num_tokens // num_seqs), generator=gen)
    return ids.to(device)
