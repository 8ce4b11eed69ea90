"""What the families the kit sizes but does not run count (kit.config.cache_kinds): each layer's
mixer (latent attention, gated attention, a Mamba-2 or gated delta-net layer, or none) and its
MLP (dense, experts beside shared ones, or none), as vLLM 0.32 builds them, so that the weights
budget charges what vLLM loads. `ParameterCounts` dispatches here for `Parts.sized_only`.
Plain arithmetic on `ModelConfig`'s fields (`arch`), no torch.

vLLM and transformers build the same tensors (tests/test_cache_kinds_counts.py builds
transformers' model on the meta device), except where noted: vLLM keeps a learned bias of the
routing scores as a parameter (DeepSeek-V3's `noaux_tc`, Nemotron-H's; transformers a buffer),
never ties DeepSeek's, Nemotron-H's or Qwen3-Next's LM head, biases no DeepSeek or Nemotron-H
attention and Qwen3-Next's Q, K and V only with `qkv_bias`, widens Nemotron-H's shared expert
n_shared_experts times; and neither loads the multi-token-prediction layers a checkpoint may
carry (DeepSeek-V3's num_nextn_predict_layers, Qwen3-Next's and Nemotron-H's `mtp.*`). Like the
kit's other counts, the vocabulary is counted as config.json gives it (vLLM pads its embedding
and LM head to a multiple of 64 rows).
"""
from __future__ import annotations


def gated(arch) -> bool:
    """Whether the family's MLPs and experts are gated (gate, up, down); Nemotron-H's are not
    (up, relu², down: vLLM's `is_act_and_mul=False`)."""
    return arch.parts.layer != "mixer"


def mlp_matrices(arch, width: int, hidden: int | None = None) -> int:
    """Elements of one MLP `width` wide: (3 gated, 2 not) × hidden × width."""
    return (2 + gated(arch)) * (hidden or arch.hidden_size) * width


def expert_weights(arch) -> int:
    """One expert's matrices: (3 or 2) × its hidden (moe_latent_size where Nemotron-H projects
    to a latent first, else hidden_size) × moe_intermediate_size."""
    return mlp_matrices(arch, arch.moe_intermediate_size, arch.moe_latent_size)


def latent_attention_weights(arch) -> int:
    """Multi-head latent attention's matrices (DeepSeek-V2/V3): the query, H × heads ×
    (nope + rope) or through its low rank r, H × r + r × heads × (nope + rope); the latent and
    rotary key, H × (kv_lora_rank + rope); their expansion to keys and values, kv_lora_rank ×
    heads × (nope + v); the output, heads × v × H."""
    h, heads, qk = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    r = arch.q_lora_rank
    query = (h * r + r * heads * qk) if r else h * heads * qk
    return query + h * arch.latent_size \
        + arch.kv_lora_rank * heads * (arch.qk_nope_head_dim + arch.v_head_dim) \
        + heads * arch.v_head_dim * h


def attention_weights(arch) -> int:
    """Attention's Q, K, V and O: H × heads × d, twice where the query also gates the output
    (Qwen3-Next's attn_output_gate), 2 × H × KV heads × d, heads × d × H."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    return h * q * (1 + arch.attn_output_gate) + 2 * h * arch.num_key_value_heads \
        * arch.head_dim + q * h


def conv_dim(rec) -> int:
    """The channels a recurrent layer convolves: inner + 2 × groups × state_dim (Mamba-2's x,
    B and C; a delta-net's v, q and k)."""
    return rec.inner + 2 * rec.groups * rec.state_dim


def recurrent_weights(arch) -> int:
    """A Mamba-2 or gated delta-net layer's matrices: the input projection, H × (conv_dim +
    inner + heads) for Mamba-2 (x B C, the gate z, dt) and H × (conv_dim + inner + 2 × heads)
    for a delta-net (q k v, z, b and a); the depthwise convolution, conv_dim × conv_kernel;
    the output projection, inner × H."""
    rec, h = arch.recurrent, arch.hidden_size
    heads = rec.heads * (1 + (rec.kind == "gated_delta_net"))
    return h * (conv_dim(rec) + rec.inner + heads) + conv_dim(rec) * rec.conv_kernel \
        + rec.inner * h


def recurrent_vectors(arch) -> int:
    """A recurrent layer's vectors: Mamba-2's A, D and dt_bias per head, its gated norm over
    inner, the convolution's bias (conv_bias) and the projections' (proj_bias); a delta-net's
    A_log and dt_bias per head and its norm over one value head."""
    rec = arch.recurrent
    if rec.kind == "gated_delta_net":
        return 2 * rec.heads + rec.head_dim
    in_proj = conv_dim(rec) + rec.inner + rec.heads
    return 3 * rec.heads + rec.inner + rec.conv_bias * conv_dim(rec) \
        + rec.proj_bias * (in_proj + arch.hidden_size)


def mixer_weights(arch, layer: int) -> int:
    """Layer `layer`'s mixer matrices: latent attention, attention, a recurrent layer, or
    none (Nemotron-H's MLP-only layers)."""
    if arch.is_recurrent(layer):
        return recurrent_weights(arch)
    if not arch.has_kv_cache(layer):
        return 0
    return latent_attention_weights(arch) if arch.kv_lora_rank else attention_weights(arch)


def mixer_vectors(arch, layer: int) -> int:
    """Layer `layer`'s mixer vectors: latent attention's norms of the latent (kv_lora_rank)
    and of the low-rank query (q_lora_rank); Qwen3-Next's per-head Q and K norms (2 d) and
    its Q, K, V biases; Granite's Q, K, V and O biases; a recurrent layer's
    (`recurrent_vectors`)."""
    if arch.is_recurrent(layer):
        return recurrent_vectors(arch)
    if not arch.has_kv_cache(layer):
        return 0
    if arch.kv_lora_rank:
        return arch.kv_lora_rank + (arch.q_lora_rank or 0)
    d, gate = arch.head_dim, 1 + arch.attn_output_gate
    qkv = (arch.num_attention_heads * gate + 2 * arch.num_key_value_heads) * d
    if arch.family.startswith("qwen3"):
        return 2 * d + arch.attention_bias * qkv
    return arch.attention_bias * (qkv + arch.hidden_size)


def shared_weights(arch) -> int:
    """The shared expert beside the routed ones (DeepSeek's n_shared_experts as one,
    Granite's shared MLP, Qwen3-Next's with its sigmoid gate, H × 1, Nemotron-H's)."""
    s = arch.shared_expert_intermediate_size
    return mlp_matrices(arch, s) + (arch.hidden_size if s and arch.parts.shared_expert_gate else 0)


def mlp_weights(arch, layer: int, active: bool = False) -> int:
    """Layer `layer`'s MLP matrices: none, a dense MLP intermediate_size wide, or the router
    (E × H), every expert (`active`: the k a token runs), Nemotron-H's projections to and from
    its experts' latent (2 × H × moe_latent_size) and the shared expert."""
    kind = arch.mlp_kinds[layer] if arch.mlp_kinds else "dense"
    if kind == "none":
        return 0
    if kind == "dense":
        return mlp_matrices(arch, arch.intermediate_size)
    experts = arch.num_experts_per_tok if active else arch.num_experts
    return arch.num_experts * arch.hidden_size + experts * expert_weights(arch) \
        + 2 * arch.hidden_size * arch.moe_latent_size + shared_weights(arch)


def layer_norms(arch) -> int:
    """A layer's norms: one before its mixer (Nemotron-H's only one), one before its MLP."""
    return arch.hidden_size * len(arch.parts.layer_norms)


def num_parameters(arch) -> int:
    """Every parameter vLLM builds (the module's docstring says where transformers differs):
    the matrices and LM head (`linear_weights`), the input embedding when untied, each
    layer's norms, its mixer's vectors and its routing-score bias (E, vLLM's), the final norm."""
    embed = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    vectors = sum(layer_norms(arch) + mixer_vectors(arch, i)
                  + arch.router_score_bias * arch.is_moe(i) * arch.num_experts
                  for i in range(arch.num_hidden_layers))
    return arch.linear_weights() + embed + vectors + arch.hidden_size


def mlp_peak_elements(arch, layer: int) -> int:
    """Elements one token holds at the peak of layer `layer`'s MLP: none; a dense MLP's
    outputs and activated product (3 × I gated, 2 × I for Nemotron-H's up and relu²); the k
    routed rows of vLLM's fused-experts workspace (a gate-and-up row, 2 × or 1 × I, sharing
    its memory with the row's down output, beside its activated row), or the shared expert
    where that holds more (it runs apart)."""
    kind = arch.mlp_kinds[layer] if arch.mlp_kinds else "dense"
    rows = 2 + gated(arch)
    if kind == "none":
        return 0
    if kind == "dense":
        return rows * arch.intermediate_size
    i = arch.moe_intermediate_size
    routed = arch.num_experts_per_tok * (max((rows - 1) * i, arch.moe_latent_size
                                             or arch.hidden_size) + i)
    return max(routed, rows * arch.shared_expert_intermediate_size)
