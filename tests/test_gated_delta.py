"""Qwen3-Next's layers in the kit (issue 35): the gated delta-net's recurrence by chunks and
step by step, the layer itself (prefill, then decode steps from its states), the gated
attention with partial RoPE and zero-centred norms, and the experts with a gated shared
expert, each against transformers' own module or function with the same weights (float32)."""
import pytest
import torch

from kit.config import ModelConfig
from kit.engine.layers import gated_delta
from kit.engine.layers.gated_attention import GatedAttention
from kit.engine.layers.shared_gate_moe import SharedGateMoE
from kit.engine.layers.rotary import rope_cos_sin

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

# 2 key heads serving 4 value heads (each key head 2), key 8 and value 6 wide; attention with
# 4 query heads over 2 KV heads of 16, a quarter of each turned by RoPE; 4 experts, top 2
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 6, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "max_position_embeddings": 256}
TOL = 1e-5


def configs():
    config = transformers.Qwen3NextConfig(**TINY)
    config._attn_implementation = "sdpa"
    return config, ModelConfig.from_dict(config.to_dict(), "tiny-gdn-layers")


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn at a scale where each matters (norm weights around 1 or 0, as
    they apply), A_log and dt_bias near trained values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    return module.eval()


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def recurrence_inputs(seqs=2, length=70, heads=4, key_dim=8, value_dim=6):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(seqs, length, heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(seqs, length, heads, value_dim, generator=gen)
    g = -torch.rand(seqs, length, heads, generator=gen) * 0.5
    beta = torch.rand(seqs, length, heads, generator=gen)
    state = torch.randn(seqs, heads, key_dim, value_dim, generator=gen)  # transformers' layout
    return q, k, v, g, beta, state


def test_both_forms_of_the_recurrence_match_transformers():
    """70 tokens (a chunk of 64 and a padded one) from a given state: the kit's chunked form
    and its step-by-step form against transformers' `torch_chunk_gated_delta_rule` and
    `torch_recurrent_gated_delta_rule`, outputs and final states (the kit's state is vLLM's
    [value, key] layout, transformers' [key, value])."""
    q, k, v, g, beta, state = recurrence_inputs()
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    rec_out, rec_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    assert relative(rec_out, ref_out) < TOL  # transformers' two forms agree
    qn, kn = gated_delta.l2_normalize(q), gated_delta.l2_normalize(k)
    out, final = gated_delta.chunked_delta_rule(qn, kn, v, g, beta,
                                                state=state.transpose(-1, -2))
    stepped = state.transpose(-1, -2).contiguous()
    step_out = gated_delta.delta_rule(qn, kn, v, g, beta, stepped)
    for got, expected in ((out, ref_out), (final.transpose(-1, -2), ref_state),
                          (step_out, rec_out), (stepped.transpose(-1, -2), rec_state)):
        assert relative(got, expected) < TOL
    # from a zero state (the prefill's), by chunks of 64 as transformers' default
    zero_out, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert relative(gated_delta.chunked_delta_rule(qn, kn, v, g, beta)[0], zero_out) < TOL


def test_the_opaque_rule_is_the_chunked_rule_and_compiles_as_one_call():
    """The operator a compiled prefill calls (`opaque_chunked_delta_rule`) gives
    `chunked_delta_rule`'s exact results, its shapes agree with its fake
    (`torch.library.opcheck`), and a function compiled with the length symbolic holds one call
    to it and serves 1, 2 and 4 chunks without compiling again (traced, the loop over chunks
    fixed their number: a guard-free prefill compiled on 64 tokens failed on 70)."""
    gen = torch.Generator().manual_seed(0)

    def inputs(length):
        q, k = (gated_delta.l2_normalize(torch.randn(2, length, 4, 8, generator=gen))
                for _ in range(2))
        v = torch.randn(2, length, 4, 6, generator=gen)
        g = -torch.rand(2, length, 4, generator=gen)
        return q, k, v, g, torch.rand(2, length, 4, generator=gen)
    args = inputs(7)
    for got, want in zip(gated_delta.opaque_chunked_delta_rule(*args, 4),
                         gated_delta.chunked_delta_rule(*args, 4)):
        assert torch.equal(got, want)
    torch.library.opcheck(gated_delta.opaque_chunked_delta_rule, (*args, 4))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm
    rule = torch.compile(lambda *t: gated_delta.opaque_chunked_delta_rule(*t, 4),
                         backend=backend, fullgraph=True)
    for length in (3, 8, 13):
        args = inputs(length)
        if length == 3:  # the prompt length symbolic, as in the CPU's compiled prefill
            for t in args:
                torch._dynamo.mark_dynamic(t, 1)
        for got, want in zip(rule(*args), gated_delta.chunked_delta_rule(*args, 4)):
            assert torch.equal(got, want)
    assert len(graphs) == 1
    assert graphs[0].count(torch.ops.kit.chunked_delta_rule.default) == 1, graphs[0]


def kit_delta_net(config, arch, layer: hf.Qwen3NextGatedDeltaNet) -> gated_delta.GatedDeltaNet:
    net = gated_delta.GatedDeltaNet(arch)
    with torch.no_grad():
        for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log",
                     "norm.weight", "out_proj.weight"):
            net.get_parameter(name).copy_(layer.get_parameter(name))
        net.conv1d.copy_(layer.conv1d.weight)
    return net.eval()


@torch.no_grad()
def test_delta_net_prefill_and_steps_match_transformers():
    """Two sequences of 9 tokens: the kit's prefill over the first 5 (from zero states), then
    4 decode steps each from the states the last left (moved on in place), against
    transformers' `Qwen3NextGatedDeltaNet` over all 9 at once."""
    config, arch = configs()
    layer = randomized(hf.Qwen3NextGatedDeltaNet(config, 0))
    net = kit_delta_net(config, arch, layer)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    expected = layer(x)
    out, conv_state, state = net.prefill(x[:, :5].reshape(10, 32), num_seqs=2)
    assert conv_state.shape == (2, net.conv_dim, 3) and state.shape == (2, 4, 6, 8)
    got = [out.view(2, 5, 32)]
    for t in range(5, 9):
        got.append(net.step(x[:, t], conv_state, state)[:, None])
    error = relative(torch.cat(got, dim=1), expected)
    print(f"delta-net prefill 5 + 4 steps: max error / max output = {error:.2e}")
    assert error < TOL
    # a prompt shorter than the convolution's taps leaves zeros before its first input
    out2, conv2, state2 = net.prefill(x[:, :2].reshape(4, 32), num_seqs=2)
    assert conv2[..., 0].abs().max() == 0 and conv2[..., 1:].abs().min() > 0
    step = net.step(x[:, 2], conv2, state2)
    assert relative(step, layer(x[:, :3])[:, 2]) < TOL


@torch.no_grad()
def test_gated_attention_matches_transformers():
    """Prefill of 2 sequences of 7 tokens: the query's gate, the zero-centred q and k norms
    and RoPE on a quarter of each head (partial_rotary_factor 0.25) against
    `Qwen3NextAttention` with the same weights (Q, K, V fused as vLLM fuses them)."""
    config, arch = configs()
    ref = randomized(hf.Qwen3NextAttention(config, 3))
    kit_attn = GatedAttention(arch, 3).eval()
    kit_attn.qkv_proj.weight.copy_(torch.cat([ref.q_proj.weight, ref.k_proj.weight,
                                              ref.v_proj.weight]))
    for name in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
        kit_attn.get_parameter(name).copy_(ref.get_parameter(name))
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(6))
    positions = torch.arange(7)
    cos_sin = hf.Qwen3NextRotaryEmbedding(config)(x, positions[None])
    expected, _ = ref(x, cos_sin, attention_mask=None)
    cos, sin = rope_cos_sin(positions.repeat(2), 4, 10000.0)  # 16 × 0.25 elements turn
    got = kit_attn(x.reshape(14, 32), cos, sin, num_seqs=2).view(2, 7, 32)
    error = relative(got, expected)
    print(f"gated attention: max error / max output = {error:.2e}")
    assert error < TOL


@torch.no_grad()
def test_experts_with_a_gated_shared_expert_match_transformers():
    config, arch = configs()
    ref = randomized(hf.Qwen3NextSparseMoeBlock(config))
    moe = SharedGateMoE(arch, 0).eval()
    moe.gate.weight.copy_(ref.gate.weight)
    moe.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
    moe.experts.down_proj.copy_(ref.experts.down_proj)
    moe.shared_expert.gate_up_proj.weight.copy_(torch.cat([ref.shared_expert.gate_proj.weight,
                                                           ref.shared_expert.up_proj.weight]))
    moe.shared_expert.down_proj.weight.copy_(ref.shared_expert.down_proj.weight)
    moe.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(7))
    error = relative(moe(x.reshape(14, 32)).view(2, 7, 32), ref(x))
    print(f"experts + gated shared expert: max error / max output = {error:.2e}")
    assert error < TOL
