import math

import pytest
import torch
import torch.nn.functional as F

from kit.config import FAMILIES, ModelConfig
from kit.engine.checkpoint import layout
from kit.engine.layers.attention import paged_decode_attention, window_blocks
from kit.engine.layers import prefill_attention as prefill_module
from kit.engine.layers.prefill_attention import prefill_attention, query_chunk
from kit.engine.layers.rotary import apply_rope, rope_cos_sin
from kit.engine.model import build_model, dummy_batch, weights_bytes


def small(family="llama", heads=4, kv_heads=2, head_dim=16, **extra):
    # Gemma 2 and 3 always have sliding layers, which need a window
    window = {"sliding_window": 8} if family in ("gemma2", "gemma3_text") else {}
    # a mixture of experts of a size to match: 4 experts, 2 per token
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} \
        if FAMILIES[family].experts else {}
    if family == "gpt_oss":  # its experts are intermediate_size wide
        del experts["moe_intermediate_size"]
    if family == "llama4_text":  # so are Llama 4's, counted as num_local_experts
        experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
    if family == "gemma4_text":  # its experts beside the dense MLPs, its own keys; K = V on
        # the full layer, whose head is wider, per-layer embeddings
        experts = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                   "moe_intermediate_size": 32, "sliding_window": 8, "global_head_dim": 32,
                   "attention_k_eq_v": True, "num_global_key_value_heads": 1,
                   "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 101}
    return ModelConfig.from_dict({
        "model_type": family, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": 101, "max_position_embeddings": 256, **window, **experts, **extra},
        f"small-{family}")


ARCHS = {
    "gqa": small(),
    "mqa-gemma": small("gemma", heads=4, kv_heads=1, head_dim=24, tie_word_embeddings=True,
                       hidden_act="gelu"),
    "mha-qwen2-bias": small("qwen2", heads=4, kv_heads=4, head_dim=16),
    "window-mistral": small("mistral", sliding_window=3),
    "window-softcap-gemma2": small("gemma2", sliding_window=3, query_pre_attn_scalar=8,
                                   attn_logit_softcapping=2.0, hidden_act="gelu"),
}


@pytest.mark.parametrize("key", ARCHS)
def test_shapes_and_weight_bytes(key):
    arch = ARCHS[key]
    model = build_model(arch, "bfloat16", "cpu", seed=0)
    ids = dummy_batch(24, 3, arch.vocab_size, "cpu")
    hidden = model(ids)
    assert ids.shape == (3, 8) and hidden.shape == (3, 8, 64)
    assert model.compute_logits(hidden[:, -1]).shape == (3, arch.vocab_size)
    assert weights_bytes(model) == arch.num_parameters() * 2


@pytest.mark.parametrize("family", [f for f, parts in FAMILIES.items() if not parts.sized_only])
def test_every_family_builds_the_parameters_its_checkpoints_hold(family):
    """Each family's description (`FAMILIES`) names parts that exist, and the parameters they
    make are the ones the checkpoint layout and the parameter count expect."""
    arch = small(family)
    model = build_model(arch, "float32", "cpu")
    assert set(layout(arch)) == {name for name, _ in model.named_parameters()} | {
        name for name, _ in model.named_buffers()}  # (Gemma 4's layer_scalar)
    assert weights_bytes(model) == arch.num_parameters() * 4


def test_float32_weights_bytes_exact():
    arch = ModelConfig.load("tiny")
    assert weights_bytes(build_model(arch, "float32", "cpu")) == arch.num_parameters() * 4


def test_same_seed_same_output_other_seed_other_output():
    arch = ARCHS["gqa"]
    ids = dummy_batch(32, 4, arch.vocab_size, "cpu")
    a = build_model(arch, "float32", "cpu", seed=1)(ids)
    b = build_model(arch, "float32", "cpu", seed=1)(ids)
    c = build_model(arch, "float32", "cpu", seed=2)(ids)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def reference_attention(q, k, v, scale=None, window=None, cap=None):
    """Plain causal softmax attention for one sequence, KV heads repeated per query group; with
    `window`, each query sees itself and the window - 1 positions before it; `cap` soft-caps
    the scaled scores."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    if cap:
        scores = cap * torch.tanh(scores / cap)
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    if window:
        mask = mask & ~torch.ones_like(mask).tril(-window)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


@pytest.mark.parametrize("key", ARCHS)
def test_attention_matches_reference_and_keeps_sequences_apart(key):
    arch = ARCHS[key]
    attn = build_model(arch, "float32", "cpu").layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2 * 5, arch.num_attention_heads, arch.head_dim, generator=gen)
    k = torch.randn(2 * 5, arch.num_key_value_heads, arch.head_dim, generator=gen)
    v = torch.randn(2 * 5, arch.num_key_value_heads, arch.head_dim, generator=gen)
    out = attn.attend(q, k, v, num_seqs=2)
    for s in range(2):
        part = slice(5 * s, 5 * s + 5)
        torch.testing.assert_close(out[part], reference_attention(
            q[part], k[part], v[part], arch.attention_scale, arch.window(0),
            arch.attn_logit_softcapping))


def test_sequences_in_a_batch_do_not_see_each_other():
    arch = ARCHS["gqa"]
    model = build_model(arch, "float32", "cpu")
    ids = dummy_batch(20, 2, arch.vocab_size, "cpu", seed=3)
    together = model(ids)
    torch.testing.assert_close(together[1:], model(ids[1:]))


def test_rope_rotates_pairs_and_keeps_norms():
    x = torch.randn(6, 2, 8)
    cos, sin = rope_cos_sin(torch.arange(6), 8, 10000.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[0], x[0])  # position 0 is not rotated
    # position 1, first pair: a rotation by angle 1 rad (inv_freq[0] = 1)
    x1, x2 = x[1, :, 0], x[1, :, 4]
    torch.testing.assert_close(y[1, :, 0], x1 * math.cos(1) - x2 * math.sin(1))


def test_dummy_batch_keeps_exact_token_count():
    for tokens, seqs in [(2048, 8), (8192, 256), (1000, 7), (13, 8)]:
        ids = dummy_batch(tokens, seqs, 50, "cpu")
        assert ids.numel() == tokens and ids.shape[0] <= seqs


def test_gemma_uses_tanh_gelu_and_offset_norm():
    gemma = ARCHS["mqa-gemma"]
    model = build_model(gemma, "float32", "cpu")
    assert model.layers[0].mlp.gelu and model.layers[0].input_layernorm.gemma
    x = torch.randn(3, 64)
    assert torch.allclose(model.norm(x), F.rms_norm(x, (64,), eps=gemma.rms_norm_eps), atol=1e-5)


@pytest.mark.parametrize("act,approximate", [("gelu", "none"), ("gelu_pytorch_tanh", "tanh"),
                                             ("gelu_new", "tanh")])
def test_gelu_is_exact_and_gelu_pytorch_tanh_approximate(act, approximate):
    """transformers' "gelu" is the erf GELU, "gelu_pytorch_tanh" and "gelu_new" the tanh
    approximation (the kit once ran the approximation for all three)."""
    mlp = build_model(small(hidden_act=act), "float32", "cpu", seed=0).layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    gate, up = F.linear(x, mlp.gate_up_proj.weight * 100).chunk(2, dim=-1)
    mlp.gate_up_proj.weight.mul_(100)  # pre-activations of order one, where the two differ
    expected = mlp.down_proj(F.gelu(gate, approximate=approximate) * up)
    other = mlp.down_proj(F.gelu(gate, approximate={"none": "tanh"}.get(approximate, "none")) * up)
    assert torch.allclose(mlp(x), expected, rtol=0, atol=1e-6)
    assert not torch.allclose(mlp(x), other, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window,block_size", [(8, 4), (10, 4), (5, 8), (16, 16)])
def test_a_sliding_layer_reads_only_its_windows_blocks(window, block_size):
    """The decode attention of a sliding layer gathers a fixed number of blocks (those that can
    hold the window) and gives what masking the whole context gives."""
    torch.manual_seed(0)
    seqs, width, kv_heads, heads, dim = 4, 12, 2, 4, 8
    cache = torch.randn(2, seqs * width, block_size, kv_heads, dim)
    tables = torch.randperm(seqs * width).view(seqs, width)
    lens = torch.tensor([3, window, window + 5, width * block_size])
    q = torch.randn(seqs, heads, dim)
    got = paged_decode_attention(q, cache, tables, lens, window=window)
    assert window_blocks(window, block_size, width) * block_size < width * block_size
    k = cache[0][tables].view(seqs, -1, kv_heads, dim).repeat_interleave(2, dim=2)
    v = cache[1][tables].view(seqs, -1, kv_heads, dim).repeat_interleave(2, dim=2)
    pos = torch.arange(width * block_size)[None, :]
    seen = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
    scores = torch.einsum("shd,slhd->shl", q, k) * dim ** -0.5
    weights = scores.masked_fill(~seen[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(got, torch.einsum("shl,slhd->shd", weights, v))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(None, 3.0), (4, None), (4, 3.0), (1, None),
                                            (30, None)])
@pytest.mark.parametrize("max_score_bytes", [1, 2 * 4 * 4 * 13 * 3, 2 * 4 * 4 * 7 * 6])
def test_chunked_prefill_attention_equals_the_whole(heads, kv_heads, window, softcap,
                                                    max_score_bytes, monkeypatch):
    """Queries in chunks, each against only the keys it can see, give the attention of the
    whole score tensor (up to float rounding): grouped, multi-query and multi-head, full with a
    cap, windowed with and without one; chunks of one query up to several, 13 not a multiple."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 13, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 13, 8, generator=gen, dtype=torch.float64)
            for _ in range(2))
    rows = query_chunk(2, heads, 13, window, max_score_bytes)
    assert 1 <= rows < 13  # the bound forces chunks
    whole = prefill_attention(q, k, v, 0.3, window, softcap)
    monkeypatch.setattr(prefill_module, "MAX_SCORE_BYTES", max_score_bytes)
    chunked = prefill_attention(q, k, v, 0.3, window, softcap)
    # capped scores are float32, and an AVX2 CPU's float32 tanh rounds a vector's lanes and a
    # tail's apart (1.8e-7 here; AVX-512 gave 0): float32's rounding there, float64's otherwise
    tol = 1e-12 if softcap is None else 1e-6
    torch.testing.assert_close(chunked, whole, rtol=tol, atol=tol)
    ref = torch.stack([reference_attention(q[s].transpose(0, 1), k[s].transpose(0, 1),
                                           v[s].transpose(0, 1), 0.3, window, softcap)
                       for s in range(2)]).transpose(1, 2)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-6)  # capped: float32 scores


def sunk_reference(scores, sinks, v):
    """Attention with a sink per head: the softmax over [scores, sink], the sink's weight
    dropped (transformers' gpt-oss written out). scores [heads, q, k], v [k, heads, dim]."""
    sink = sinks.view(-1, 1, 1).expand(*scores.shape[:2], 1).to(scores.dtype)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [None, 4])
def test_sinks_join_the_softmax_in_prefill_whole_and_chunked(window, monkeypatch):
    """gpt-oss's sinks: prefill (whole, and in query chunks) equals the softmax written out with
    one more logit per head; sinks far below the scores change nothing, near them they do."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 13, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    whole = prefill_attention(q, k, v, 0.3, window, None, sinks)
    monkeypatch.setattr(prefill_module, "MAX_SCORE_BYTES", 2 * 4 * 4 * 7 * 6)
    torch.testing.assert_close(prefill_attention(q, k, v, 0.3, window, None, sinks), whole)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    pos = torch.arange(13)
    seen = (pos[None] <= pos[:, None]) & ((pos[None] > pos[:, None] - window) if window else True)
    for s in range(2):
        scores = (q[s] @ kk[s].transpose(-1, -2) * 0.3).masked_fill(~seen, float("-inf"))
        torch.testing.assert_close(whole[s].transpose(0, 1),  # float32 scores in the kit
                                   sunk_reference(scores, sinks, vv[s].transpose(0, 1)),
                                   rtol=1e-5, atol=1e-6)
    plain = prefill_attention(q, k, v, 0.3, window)
    assert not torch.allclose(whole, plain, atol=1e-3)
    torch.testing.assert_close(prefill_attention(q, k, v, 0.3, window, None, sinks - 1e3), plain)


@pytest.mark.parametrize("summed", [False, True])
def test_sinks_join_the_softmax_in_paged_decode(summed):
    """The paged decode step with sinks, as two matmuls and as the summed products compiled
    code runs, equals the softmax written out with one more logit per head."""
    from kit.engine.layers.attention import summed_attention
    torch.manual_seed(0)
    seqs, width, block_size, kv_heads, heads, dim = 3, 4, 4, 2, 4, 8
    cache = torch.randn(2, seqs * width, block_size, kv_heads, dim)
    tables = torch.randperm(seqs * width).view(seqs, width)
    lens, q, sinks = torch.tensor([3, 9, 16]), torch.randn(seqs, heads, dim), torch.randn(heads)
    with summed_attention() if summed else torch.no_grad():
        got = paged_decode_attention(q, cache, tables, lens, sinks=sinks)
    k = cache[0][tables].view(seqs, -1, kv_heads, dim).repeat_interleave(2, dim=2)
    v = cache[1][tables].view(seqs, -1, kv_heads, dim).repeat_interleave(2, dim=2)
    for s in range(seqs):
        scores = torch.einsum("hd,lhd->hl", q[s], k[s, :lens[s]])[:, None] * dim ** -0.5
        torch.testing.assert_close(got[s], sunk_reference(scores, sinks, v[s, :lens[s]])[0])


def test_a_chunk_of_scores_stays_within_the_bound():
    """A chunk's scores (seqs × heads × its queries × the keys it sees, float32) fit the bound;
    the whole tensor goes at once when it fits: at the gpu preset's 8 prompts of 8,176 tokens
    and 8 heads with a window of 1,022, chunks; at the CPU presets' longest prefills, none."""
    from kit.engine.layers.prefill_attention import MAX_SCORE_BYTES
    for seqs, heads, length, window in [(8, 8, 8176, 1022), (8, 8, 8176, None), (3, 5, 999, 7)]:
        rows = query_chunk(seqs, heads, length, window, 10**7)
        keys = length if window is None else min(length, rows + window - 1)
        assert rows < length and seqs * heads * rows * keys * 4 <= 10**7
    assert query_chunk(8, 8, 8176, 1022) < 8176
    assert query_chunk(8, 14, 2032, 254) == 2032  # cpu-real, chapter 04's longest prompts
    assert query_chunk(4, 8, 1008, 126) == 1008  # cpu-small's
    assert 8 * 14 * 2032 ** 2 * 4 <= MAX_SCORE_BYTES


# ---------------------------------------------------------------------------------------------
# Experts: routing, the grouped products, and what a step reads
# ---------------------------------------------------------------------------------------------

def naive_experts(moe, x):
    """Each token's k experts run one by one, weighted: the definition."""
    weights, ids = moe.route(x)
    out = torch.zeros(x.shape, dtype=torch.float32)
    ex = moe.experts
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            hidden = ex.act(F.linear(x[t], ex.gate_up_proj[e]))
            out[t] += w * F.linear(hidden, ex.down_proj[e]).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_experts_equal_each_tokens_experts_run_one_by_one(family, dtype):
    from kit.engine.layers.experts import SparseMoE
    arch = small(family, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24)
    torch.manual_seed(0)
    moe = SparseMoE(arch).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(11, 64, dtype=dtype)
    got, expected = moe(x).float(), naive_experts(moe, x).float()
    assert (got - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2) \
        * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_a_decode_steps_few_pairs_take_one_kernel(dtype):
    """Compiled, a decode step whose (token, expert) pairs are no more than the experts runs
    each product as one kernel (`expert_products` on the CPU, `gathered_products` elsewhere),
    a prefill the grouped products: each gives the definition's output, and neither the kernel
    nor the gathered loop reads an expert that no token picked (NaN weights there leave them
    finite)."""
    from kit.engine.layers import experts
    arch = small("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    torch.manual_seed(0)
    moe = experts.SparseMoE(arch).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    moe.requires_grad_(False)
    compiled = torch.compile(moe, fullgraph=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for tokens in (3, 9):  # 6 pairs of 8 experts: gathered; 18: grouped
        x = torch.randn(tokens, 64, dtype=dtype)
        got, expected = compiled(x).float(), naive_experts(moe, x).float()
        assert (got - expected).abs().max() <= tol * expected.abs().max()
    x = torch.randn(3, 64, dtype=dtype)
    _, ids = moe.route(x)
    unpicked = sorted(set(range(8)) - set(ids.flatten().tolist()))
    moe.experts.gate_up_proj[unpicked] = float("nan")
    moe.experts.down_proj[unpicked] = float("nan")
    assert torch.isfinite(compiled(x)).all()
    picked = ids.flatten()[:3].sort().values
    gathered = experts.gathered_products(x, moe.experts.gate_up_proj.detach(), picked, block=32)
    assert gathered.shape == (3, 48)  # 48 output rows: blocks of 16, the largest that divides
    assert torch.isfinite(gathered).all()
    kernel = experts.expert_products(x, moe.experts.gate_up_proj.detach(), picked)
    assert torch.isfinite(kernel).all()
    assert (kernel.float() - gathered.float()).abs().max() <= tol * gathered.float().abs().max()


def test_routing_renormalises_only_where_the_config_says():
    from kit.engine.layers.experts import route
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]] and w.sum().item() < 0.99
    w, _ = route(logits, 2, renormalize=True)
    assert w.sum().item() == pytest.approx(1.0)
    assert w[0, 0].item() == pytest.approx(math.e / (math.e + 1))


def test_an_expert_no_token_picked_is_never_read():
    """The grouped products read only the picked experts: NaN weights in the others leave
    the output finite (and a picked expert's NaN shows)."""
    from kit.engine.layers.experts import grouped_mm
    rows, weights = torch.randn(5, 8), torch.randn(4, 8, 4)
    ends = torch.tensor([2, 2, 5, 5], dtype=torch.int32)  # experts 1 and 3 picked by no row
    weights[1] = weights[3] = float("nan")
    out = grouped_mm(rows, weights, ends)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:2], rows[:2] @ weights[0]) and \
        torch.allclose(out[2:], rows[2:] @ weights[2])
    weights[2] = float("nan")
    assert not torch.isfinite(grouped_mm(rows, weights, ends)[2:]).any()


def test_the_fallback_without_grouped_products_gives_the_same_rows(monkeypatch):
    """Where the grouped product does not run (a device or dtype without it, or sizes whose
    strides are not multiples of 16 bytes), a product per group gives the same rows."""
    from kit.engine.layers import experts
    rows, weights = torch.randn(7, 8), torch.randn(3, 8, 4)
    ends = torch.tensor([3, 3, 7], dtype=torch.int32)
    grouped = experts.grouped_mm(rows, weights, ends)
    monkeypatch.setitem(experts._GROUPED_WORKS, ("cpu", torch.float32), False)
    assert torch.allclose(experts.grouped_mm(rows, weights, ends), grouped, atol=1e-6)
    odd = torch.randn(3, 8, 3)  # 12-byte rows: torch refuses, the loop runs
    by_group = torch.cat([rows[:3] @ odd[0], rows[3:] @ odd[2]])
    monkeypatch.undo()
    assert torch.allclose(experts.grouped_mm(rows, odd, ends), by_group, atol=1e-6)
    # a CUDA graph's capture cannot read `ends` on the host: every group's product, masked
    assert torch.allclose(experts.masked_products(rows, odd, ends), by_group, atol=1e-6)
    assert torch.allclose(experts.masked_products(rows, weights, ends), grouped, atol=1e-6)


def test_expected_distinct_experts():
    from kit.engine.layers.experts import distinct_experts, expected_distinct_experts
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(8, 2, 1000) == pytest.approx(8)
    assert expected_distinct_experts(128, 8, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert distinct_experts(torch.tensor([[0, 3], [3, 5]])) == 3


def test_an_moe_forward_compiles_to_one_graph():
    """Routing keeps every shape fixed by the number of tokens: Dynamo traces the whole MoE
    model as one graph, without a break (a `bincount` or a host loop over experts breaks)."""
    arch = small("qwen3_moe")
    model = build_model(arch, "float32", "cpu")
    explained = torch._dynamo.explain(model.forward)(torch.randint(0, 101, (2, 5)))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


@pytest.mark.parametrize("chunk", [1, 4, 5, 13])
@pytest.mark.parametrize("max_score_bytes", [1, 2 * 4 * 4 * 13 * 3])
def test_chunked_local_prefill_sees_only_each_querys_chunk(chunk, max_score_bytes, monkeypatch):
    """Llama 4's chunked local attention: each query attends to the earlier keys of its own
    chunk (written out here per query); the queries in bounded pieces give the same."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 13, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    whole = prefill_attention(q, k, v, 0.3, chunk=chunk)
    monkeypatch.setattr(prefill_module, "MAX_SCORE_BYTES", max_score_bytes)
    torch.testing.assert_close(prefill_attention(q, k, v, 0.3, chunk=chunk), whole,
                               rtol=1e-12, atol=1e-12)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for p in range(13):
        first = p // chunk * chunk
        weights = (q[:, :, p:p + 1] @ kk[:, :, first:p + 1].transpose(-1, -2) * 0.3).softmax(-1)
        torch.testing.assert_close(whole[:, :, p:p + 1], weights @ vv[:, :, first:p + 1])


def test_a_decode_steps_pairs_take_one_kernel_on_the_cpu_and_a_prefills_do_not():
    """On the CPU, float32 or bf16, no more pairs than experts (a decode step) run the expert
    kernel; more (a prefill) the grouped products; float16 never the kernel."""
    from kit.engine.layers.experts import Experts
    experts = Experts(small("qwen3_moe"))
    assert experts.kernel_built  # a C compiler is on every machine the kit tests on
    assert experts.one_kernel(4) and not experts.one_kernel(5)
    assert experts.to(torch.bfloat16).one_kernel(4)
    assert not experts.to(torch.float16).one_kernel(4)