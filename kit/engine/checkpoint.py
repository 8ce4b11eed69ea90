"""Checkpoint folders in the Hugging Face layout: config.json and safetensors weights.

`load_checkpoint` fills a `Decoder` from the folder `arch.checkpoint` (memory-mapped, cast to
the model's dtype, Q/K/V and gate/up copied into the fused matrices, each expert's matrices into
the stacked ones, gpt-oss's stacked experts converted to the kit's layout: `CONVERSIONS`);
`write_checkpoint`
writes a model's weights under Hugging Face's names, which transformers and vLLM load. Only
safetensors are read, never pickles. Gemma's norms are stored as an offset from 1 both here
and in transformers (`GemmaRMSNorm` multiplies by 1 + w), so they map one to one; so are
Gemma 3's per-head `q_norm` and `k_norm` (Qwen3's hold the scale itself, as the kit's do).
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kit.config import ModelConfig, checkpoint_files
from kit.config.families import EXPERT_NAMES
from kit.engine.recurrent_tensors import gated_delta_tensors, mamba2_tensors
from kit.errors import ConfigError

# safetensors dtypes a float model can be cast from
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
IGNORED = (".rotary_emb.inv_freq",)  # buffers older checkpoints carry; recomputed here


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate and up columns alternating -> gate's, then up's (the kit's halves)."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def interleave(t: torch.Tensor) -> torch.Tensor:
    """The kit's gate half, then up half -> gpt-oss's alternating columns."""
    return torch.stack(t.chunk(2, dim=-1), dim=-1).flatten(-2)


def swap_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


# Tensors a checkpoint stores in another layout than the kit's parameter: the last part of the
# kit's name -> (checkpoint -> kit, kit -> checkpoint). gpt-oss stores every expert in one tensor,
# [E, in, out] (`gate_up_proj` [E, H, 2I] with gate and up columns alternating), where the kit
# holds [E, out, in] with gate's rows, then up's (vLLM's FusedMoE layout).
CONVERSIONS = {"gpt_oss": {
    "experts.gate_up_proj": (lambda t: swap_last(deinterleave(t)),
                             lambda p: interleave(swap_last(p))),
    "experts.gate_up_proj_bias": (deinterleave, interleave),
    "experts.down_proj": (swap_last, swap_last),
}, "llama4": {  # [E, H, 2I], gate's columns then up's, and [E, I, H]: transposed only
    "experts.gate_up_proj": (swap_last, swap_last),
    "experts.down_proj": (swap_last, swap_last),
}}
ROTATED = ("q_proj.weight", "k_proj.weight")  # the projections RoPE turns


def pairs_to_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's rows in RoPE pairs of adjacent rows (Meta's layout, Llama 4's checkpoints)
    -> the even rows, then the odd ones (the halves the kit rotates): vLLM's
    `permute_qk_weight_for_rotary`. Attention is unchanged, as q and k move alike."""
    rows, cols = t.shape
    return t.view(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    rows, cols = t.shape
    return t.view(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def conversion(arch: ModelConfig, kit_name: str, hf_name: str = ""):
    """The (to kit, to checkpoint) pair for parameter `kit_name`'s part `hf_name`, None when
    stored as it is: stacked experts (`CONVERSIONS`; Gemma 4's stacked as the kit stacks them,
    rows per expert), and Llama 4's q and k rows."""
    if arch.parts.rope_pairs == "interleaved" and hf_name.endswith(ROTATED):
        d = arch.head_dim
        return (lambda t: pairs_to_halves(t, d)), (lambda p: halves_to_pairs(p, d))
    if arch.parts.gemma4 and kit_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return (lambda t: t, lambda p: p)
    return CONVERSIONS.get(arch.parts.expert_names, {}).get(kit_name.partition(".mlp.")[2])


def layout(arch: ModelConfig) -> dict[str, list[str]]:
    """Each kit parameter -> the Hugging Face tensors stacked (along dim 0) to make it."""
    return {kit: [name for name, _ in parts] for kit, parts in tensors_of(arch).items()}


def hf_shapes(arch: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `arch` holds, with its shape."""
    return {name: shape for parts in tensors_of(arch).values() for name, shape in parts}


def tensors_of(arch: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each kit parameter -> the Hugging Face tensors (name, shape) stacked along dim 0 to make
    it; a stacked expert matrix [E, rows, cols] is E × rows rows of its experts' tensors."""
    h, vocab = arch.hidden_size, arch.vocab_size
    if arch.parts.layer == "mixer":
        return nemotron_tensors(arch)
    parts = {"embed_tokens.weight": [("model.embed_tokens.weight", (vocab, h))],
             "norm.weight": [("model.norm.weight", (h,))]}
    if not arch.tie_word_embeddings:
        parts["lm_head.weight"] = [("lm_head.weight", (vocab, h))]
    for i in range(arch.num_hidden_layers):
        kit, hf = f"layers.{i}.", f"model.layers.{i}."
        if arch.family == "granitemoehybrid":
            parts.update(granite_layer_tensors(arch, kit, hf, i))
            continue
        attention = latent_attention_tensors if arch.latent_size else attention_tensors
        if arch.is_recurrent(i) and arch.recurrent.kind == "gated_delta_net":
            parts.update(gated_delta_tensors(arch, kit + "self_attn.", hf + "linear_attn."))
        else:
            parts.update(attention(arch, kit + "self_attn.", hf + "self_attn.", i))
        mlp = dense_mlp_tensors if not arch.is_moe(i) or arch.parts.gemma4 else \
            deepseek_experts_tensors if arch.latent_size else stacked_experts_tensors if arch.parts.expert_names == "gpt_oss" else \
            llama4_experts_tensors if arch.parts.expert_names == "llama4" else \
            gated_shared_experts_tensors if arch.parts.shared_expert_gate else experts_tensors
        parts.update(mlp(arch, kit + "mlp.", hf, i))
        for norm in arch.parts.layer_norms:
            parts[f"{kit}{norm}.weight"] = [(f"{hf}{norm}.weight", (h,))]
        if arch.parts.gemma4:
            parts.update(gemma4_layer_tensors(arch, kit, hf))
    if arch.hidden_size_per_layer_input:
        parts.update(per_layer_input_tensors(arch))
    return parts


def granite_layer_tensors(arch: ModelConfig, kit: str, hf: str, layer: int) -> dict:
    """A Granite-4.0-H layer: its Mamba-2 mixer (`mamba.*`) or attention, its two norms, and
    its experts (`block_sparse_moe`: the router's `router.layer`, every expert's gate and up
    rows in `input_linear` [E, 2I, H], `output_linear` [E, H, I]: the kit's layout) beside the
    shared MLP (`shared_mlp`, gate and up in `input_linear`), or that MLP alone."""
    h = arch.hidden_size
    parts = mamba2_tensors(arch, kit + "self_attn.", hf + "mamba.") if arch.is_recurrent(layer) \
        else attention_tensors(arch, kit + "self_attn.", hf + "self_attn.", layer)
    for norm in arch.parts.layer_norms:
        parts[f"{kit}{norm}.weight"] = [(f"{hf}{norm}.weight", (h,))]
    shared = arch.shared_expert_intermediate_size if arch.is_moe(layer) else arch.intermediate_size
    mlp = f"{kit}mlp.shared_expert." if arch.is_moe(layer) else f"{kit}mlp."
    parts.update({f"{mlp}gate_up_proj.weight": [(f"{hf}shared_mlp.input_linear.weight",
                                                 (2 * shared, h))],
                  f"{mlp}down_proj.weight": [(f"{hf}shared_mlp.output_linear.weight", (h, shared))]})
    if arch.is_moe(layer):
        e, inter, moe = arch.num_experts, arch.moe_intermediate_size, f"{hf}block_sparse_moe."
        parts.update({
            f"{kit}mlp.gate.weight": [(f"{moe}router.layer.weight", (e, h))],
            f"{kit}mlp.experts.gate_up_proj": [(f"{moe}input_linear.weight", (e, 2 * inter, h))],
            f"{kit}mlp.experts.down_proj": [(f"{moe}output_linear.weight", (e, h, inter))]})
    return parts


def nemotron_tensors(arch: ModelConfig) -> dict:
    """Nemotron-H's names: `backbone.embeddings`, `backbone.norm_f`, and each layer's `norm`
    and `mixer` (Mamba-2, attention, or the MLP's up_proj and down_proj)."""
    h, vocab, inter = arch.hidden_size, arch.vocab_size, arch.intermediate_size
    parts = {"embed_tokens.weight": [("backbone.embeddings.weight", (vocab, h))],
             "norm.weight": [("backbone.norm_f.weight", (h,))],
             "lm_head.weight": [("lm_head.weight", (vocab, h))]}
    for i in range(arch.num_hidden_layers):
        kit, hf = f"layers.{i}.", f"backbone.layers.{i}."
        parts[f"{kit}norm.weight"] = [(f"{hf}norm.weight", (h,))]
        if arch.is_recurrent(i):
            parts.update(mamba2_tensors(arch, kit + "self_attn.", hf + "mixer."))
        elif arch.has_kv_cache(i):
            parts.update(attention_tensors(arch, kit + "self_attn.", hf + "mixer.", i))
        else:
            shapes = {"up_proj": (inter, h), "down_proj": (h, inter)}
            for name, shape in shapes.items():
                parts[f"{kit}mlp.{name}.weight"] = [(f"{hf}mixer.{name}.weight", shape)]
                if arch.hybrid.mlp_bias:
                    parts[f"{kit}mlp.{name}.bias"] = [(f"{hf}mixer.{name}.bias", shape[:1])]
    return parts


def gemma4_layer_tensors(arch: ModelConfig, kit: str, hf: str) -> dict:
    """A Gemma 4 layer's stored scalar (a buffer) and per-layer input gate and projection."""
    h, p = arch.hidden_size, arch.hidden_size_per_layer_input
    parts = {f"{kit}layer_scalar": [(f"{hf}layer_scalar", (1,))]}
    if p:
        parts.update({
            f"{kit}per_layer.per_layer_input_gate.weight":
                [(f"{hf}per_layer_input_gate.weight", (p, h))],
            f"{kit}per_layer.per_layer_projection.weight":
                [(f"{hf}per_layer_projection.weight", (h, p))],
            f"{kit}per_layer.post_per_layer_input_norm.weight":
                [(f"{hf}post_per_layer_input_norm.weight", (h,))]})
    if arch.is_moe(int(kit.split(".")[1])):
        parts.update(gemma4_moe_tensors(arch, kit, hf))
    return parts


def gemma4_moe_tensors(arch: ModelConfig, kit: str, hf: str) -> dict:
    """A Gemma 4 MoE layer's router (`router.proj`, `router.scale`, `router.per_expert_scale`),
    its experts as transformers stacks them ([E, 2I, H] gate rows then up rows, [E, H, I]: the
    kit's own layout) and the three norms around them."""
    h, inter, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    parts = {f"{kit}moe.gate.weight": [(f"{hf}router.proj.weight", (e, h))],
             f"{kit}moe.scale": [(f"{hf}router.scale", (h,))],
             f"{kit}moe.per_expert_scale": [(f"{hf}router.per_expert_scale", (e,))],
             f"{kit}moe.experts.gate_up_proj": [(f"{hf}experts.gate_up_proj", (e, 2 * inter, h))],
             f"{kit}moe.experts.down_proj": [(f"{hf}experts.down_proj", (e, h, inter))]}
    for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                 "post_feedforward_layernorm_2"):
        parts[f"{kit}{norm}.weight"] = [(f"{hf}{norm}.weight", (h,))]
    return parts


def per_layer_input_tensors(arch: ModelConfig) -> dict:
    """Gemma 4's per-layer embeddings: the table, the projection of the embeddings, its norm."""
    h, p, width = arch.hidden_size, arch.hidden_size_per_layer_input, arch.per_layer_width
    kit, hf = "per_layer_inputs.", "model."
    return {f"{kit}embed_tokens_per_layer.weight":
            [(f"{hf}embed_tokens_per_layer.weight", (arch.vocab_size_per_layer_input, width))],
            f"{kit}per_layer_model_projection.weight":
            [(f"{hf}per_layer_model_projection.weight", (width, h))],
            f"{kit}per_layer_projection_norm.weight":
            [(f"{hf}per_layer_projection_norm.weight", (p,))]}


def attention_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """Q, K, V (those the layer has: Gemma 4's KV-shared layers have only Q, its K = V layers
    no V) in the fused matrix, O, biases, sinks and the per-head norms."""
    h, d = arch.hidden_size, arch.layer_head_dim(layer)
    q, kv = arch.num_attention_heads * d, arch.layer_kv_heads(layer) * d
    rows = {"q": q * (2 if arch.attn_output_gate else 1), "k": kv, "v": kv}  # Qwen3-Next's gate
    which = "qkv"[:1 + arch.has_kv_cache(layer) + arch.has_v_proj(layer)]
    parts = {f"{kit}qkv_proj.weight": [(f"{hf}{p}_proj.weight", (rows[p], h)) for p in which],
             f"{kit}o_proj.weight": [(f"{hf}o_proj.weight", (h, q))]}
    if arch.attention_bias:
        parts[f"{kit}qkv_proj.bias"] = [(f"{hf}{p}_proj.bias", (rows[p],)) for p in "qkv"]
    if arch.attention_bias and arch.parts.o_bias:
        parts[f"{kit}o_proj.bias"] = [(f"{hf}o_proj.bias", (h,))]
    if arch.parts.sinks:
        parts[f"{kit}sinks"] = [(f"{hf}sinks", (arch.num_attention_heads,))]
    norms = ("q_norm", "k_norm")[:1 + arch.has_kv_cache(layer)] if arch.parts.qk_norm else ()
    for norm in norms:  # one scale per element
        parts[f"{kit}{norm}.weight"] = [(f"{hf}{norm}.weight", (d,))]
    return parts


def latent_attention_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """DeepSeek's latent attention (`kit.engine.layers.mla`), each matrix under its own name."""
    h, heads, rank, rope = (arch.hidden_size, arch.num_attention_heads, arch.kv_lora_rank,
                            arch.qk_rope_head_dim)
    q_out, ql = heads * (arch.qk_nope_head_dim + rope), arch.q_lora_rank
    shapes = {"q_a_proj": (ql, h), "q_b_proj": (q_out, ql)} if ql else {"q_proj": (q_out, h)}
    shapes.update({"kv_a_proj_with_mqa": (rank + rope, h),
                   "kv_b_proj": (heads * (arch.qk_nope_head_dim + arch.v_head_dim), rank),
                   "o_proj": (h, heads * arch.v_head_dim), "kv_a_layernorm": (rank,)})
    if ql:
        shapes["q_a_layernorm"] = (ql,)
    return {f"{kit}{name}.weight": [(f"{hf}{name}.weight", shape)]
            for name, shape in shapes.items()}


def deepseek_experts_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """DeepSeek's router (V3's with its bias) and experts (Qwen's names) and its shared
    experts, one gated MLP."""
    parts = experts_tensors(arch, kit, hf, layer)
    if arch.router_score_bias:
        parts[f"{kit}e_score_correction_bias"] = [(f"{hf}mlp.gate.e_score_correction_bias",
                                                    (arch.num_experts,))]
    if arch.shared_expert_intermediate_size:
        parts.update(gated_mlp_tensors(arch, kit + "shared_experts.", f"{hf}mlp.shared_experts.",
                                       arch.shared_expert_intermediate_size))
    return parts


def gated_shared_experts_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """Qwen3-Next's router and experts (Qwen's names), its shared expert and that expert's
    gate (`shared_expert_gate` [1, H])."""
    parts = experts_tensors(arch, kit, hf, layer)
    if arch.shared_expert_intermediate_size:
        parts.update(gated_mlp_tensors(arch, kit + "shared_expert.", f"{hf}mlp.shared_expert.",
                                       arch.shared_expert_intermediate_size))
        parts[f"{kit}shared_expert_gate.weight"] = [(f"{hf}mlp.shared_expert_gate.weight",
                                                     (1, arch.hidden_size))]
    return parts


def dense_mlp_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """A dense layer's MLP (Llama 4's is `feed_forward`, `intermediate_size_mlp` wide; Gemma
    4 doubles some layers')."""
    return gated_mlp_tensors(arch, kit, f"{hf}{arch.parts.mlp_name}.",
                             arch.layer_intermediate_size(layer))


def gated_mlp_tensors(arch: ModelConfig, kit: str, hf: str, inter: int) -> dict:
    h = arch.hidden_size
    return {f"{kit}gate_up_proj.weight": [(f"{hf}gate_proj.weight", (inter, h)),
                                          (f"{hf}up_proj.weight", (inter, h))],
            f"{kit}down_proj.weight": [(f"{hf}down_proj.weight", (h, inter))]}


def llama4_experts_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """Llama 4's router, experts ([E, in, out] each, as transformers writes them, converted at
    load and write: `CONVERSIONS`) and shared expert."""
    h, inter, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    block = f"{hf}feed_forward."
    return {f"{kit}gate.weight": [(f"{block}router.weight", (e, h))],
            f"{kit}experts.gate_up_proj": [(f"{block}experts.gate_up_proj", (e, h, 2 * inter))],
            f"{kit}experts.down_proj": [(f"{block}experts.down_proj", (e, inter, h))],
            **gated_mlp_tensors(arch, kit + "shared_expert.", f"{block}shared_expert.",
                                arch.shared_expert_intermediate_size)}


def experts_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """The router and every expert under the family's names (`EXPERT_NAMES`): one tensor per
    expert and matrix, as published checkpoints and transformers' `save_pretrained` write
    them."""
    block, router, gate, up, down = EXPERT_NAMES[arch.parts.expert_names]
    h, inter, experts = arch.hidden_size, arch.moe_intermediate_size, range(arch.num_experts)
    name = f"{hf}{block}.experts.{{}}.{{}}.weight".format
    return {f"{kit}gate.weight": [(f"{hf}{block}.{router}.weight", (arch.num_experts, h))],
            f"{kit}experts.gate_up_proj": [(name(e, w), (inter, h)) for e in experts
                                           for w in (gate, up)],
            f"{kit}experts.down_proj": [(name(e, down), (h, inter)) for e in experts]}


def stacked_experts_tensors(arch: ModelConfig, kit: str, hf: str, layer: int = 0) -> dict:
    """gpt-oss's router (biased) and experts, each matrix and bias one tensor for all experts
    (as transformers writes them): [E, in, out], converted at load and write (`CONVERSIONS`)."""
    h, inter, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    return {f"{kit}gate.weight": [(f"{hf}mlp.router.weight", (e, h))],
            f"{kit}gate.bias": [(f"{hf}mlp.router.bias", (e,))],
            f"{kit}experts.gate_up_proj": [(f"{hf}mlp.experts.gate_up_proj", (e, h, 2 * inter))],
            f"{kit}experts.gate_up_proj_bias": [(f"{hf}mlp.experts.gate_up_proj_bias",
                                                 (e, 2 * inter))],
            f"{kit}experts.down_proj": [(f"{hf}mlp.experts.down_proj", (e, inter, h))],
            f"{kit}experts.down_proj_bias": [(f"{hf}mlp.experts.down_proj_bias", (e, h))]}


def open_files(stack: ExitStack, files: list[Path]) -> dict:
    """Tensor name -> the open (memory-mapped) file holding it; unreadable files refused."""
    where = {}
    for path in files:
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a readable safetensors file (truncated or "
                              f"damaged?): {e}") from None
        where.update({name: handle for name in handle.keys()})
    return where


def unused_kv_tensors(arch: ModelConfig) -> set:
    """K and V tensors a Gemma 4 checkpoint may keep for its KV-shared layers, which use
    their source layer's (transformers ignores them on load too)."""
    return {f"model.layers.{i}.self_attn.{name}.weight"
            for i in range(arch.num_hidden_layers) if not arch.has_kv_cache(i)
            for name in ("k_proj", "v_proj", "k_norm", "v_norm")}


def check_tensors(arch: ModelConfig, where: dict) -> None:
    """Names every missing, unexpected, mis-shaped or non-float tensor, from headers only."""
    expected = hf_shapes(arch)
    found = {n for n in where if not n.endswith(IGNORED) and n not in unused_kv_tensors(arch)}
    if arch.tie_word_embeddings:
        found.discard("lm_head.weight")  # some tied checkpoints keep the copy; it is unused
    problems = []
    if missing := sorted(set(expected) - found):
        problems.append(f"missing {missing}")
    if extra := sorted(found - set(expected)):
        problems.append(f"unexpected {extra}")
    for name in sorted(set(expected) & found):
        part = where[name].get_slice(name)
        if tuple(part.get_shape()) != expected[name]:
            problems.append(f"{name} has shape {tuple(part.get_shape())}, "
                            f"expected {expected[name]}")
        if part.get_dtype() not in FLOAT_DTYPES:
            problems.append(f"{name} is {part.get_dtype()}, which cannot be cast to a float "
                            "model's dtype")
    if problems:
        raise ConfigError(f"checkpoint {arch.checkpoint} does not match its config.json "
                          f"({arch.name}): " + "; ".join(problems))


@torch.no_grad()
def copy_into(param: torch.Tensor, parts: list[str], where: dict, converts=None) -> None:
    """Copy (and cast) the named tensors, each through its `converts` entry where given, into
    consecutive rows of `param` (of its experts' rows, for a stacked expert matrix)."""
    param, row = rows_of(param), 0
    for name, convert in zip(parts, converts or [None] * len(parts)):
        tensor = where[name].get_tensor(name)
        tensor = rows_of(convert(tensor) if convert else tensor)
        rows = param[row:row + tensor.shape[0]]
        rows.copy_(tensor)
        if not torch.isfinite(rows).all() and torch.isfinite(tensor).all():
            raise ConfigError(f"{name} overflows {param.dtype} (values up to "
                              f"{tensor.abs().max().item():.3g}); use a wider dtype")
        row += tensor.shape[0]


def rows_of(param: torch.Tensor) -> torch.Tensor:
    """`param` as rows: a stacked expert matrix [E, rows, cols] as [E × rows, cols]."""
    return param.flatten(0, 1) if param.dim() == 3 else param


def check_checkpoint(arch: ModelConfig) -> None:
    """Refuse a folder whose files or tensors do not fit `arch`, reading only the headers."""
    with ExitStack() as stack:
        check_tensors(arch, open_files(stack, checkpoint_files(Path(arch.checkpoint))))


def load_checkpoint(model: torch.nn.Module, arch: ModelConfig) -> None:
    """Fill `model` (allocated, any dtype and device) with the weights of `arch.checkpoint`,
    after checking every tensor's name, shape and dtype against the config."""
    with ExitStack() as stack:
        where = open_files(stack, checkpoint_files(Path(arch.checkpoint)))
        check_tensors(arch, where)
        params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        for kit_name, parts in layout(arch).items():
            converts = [conversion(arch, kit_name, name) for name in parts]
            copy_into(params[kit_name], parts, where, [c and c[0] for c in converts])


def hf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names, fused matrices split back apart."""
    tensors, params = {}, {**dict(model.named_buffers()), **dict(model.named_parameters())}
    shapes = hf_shapes(model.arch)
    for kit_name, parts in layout(model.arch).items():
        param = params[kit_name].detach()
        convert = conversion(model.arch, kit_name, parts[0])
        if len(parts) == 1:  # one tensor (stacked experts, a convolution), in its layout
            tensors[parts[0]] = (convert[1](param) if convert else
                                 param.reshape(shapes[parts[0]])).cpu().contiguous()
            continue
        sizes = [shapes[name][0] for name in parts]
        for name, piece in zip(parts, rows_of(param).split(sizes)):
            convert = conversion(model.arch, kit_name, name)
            tensors[name] = (convert[1](piece) if convert else piece).cpu().contiguous()
    return tensors


def write_checkpoint(model: torch.nn.Module, out: Path) -> Path:
    """Write `model` to the folder `out` as config.json and model.safetensors."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = {**model.arch.hf_dict(), "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(hf_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
