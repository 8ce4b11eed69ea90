"""Mamba-2 hybrids run by the kit (issue 35): on checkpoints transformers wrote
(`GraniteMoeHybridConfig`, tiny shapes, float32), the prefill and every paged decode step (each
sequence's recurrent state in its slot, `kit.engine.layers.state_slots`) against transformers'
forward, and against the kit's own no-cache reference."""
import dataclasses

import pytest
import torch

import kit
from kit.config import ModelConfig
from kit.config.settings import check_runnable
from kit.engine.decode import batch_for_run, generate, make_prompts, step_function
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.layers.mamba2 import chunked_scan, opaque_chunked_scan
from kit.engine.model import build_model
from kit.engine.no_cache import check_against_no_cache
from kit.errors import ConfigError
from tests.test_checkpoint import (edit_tensors, kit_and_reference_logits, kit_model,
                                   kit_paged_decode, paged_error, reference_model, relative_error)

# 3 Mamba-2 layers and 1 attention layer (NoPE), 4 experts (2 per token) beside a shared MLP;
# Mamba chunks of 8 positions, so prompts of 11 and 13 tokens run two chunks
GRANITE = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 48,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32,
           "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
           "mamba_chunk_size": 8, "layer_types": ["mamba", "mamba", "attention", "mamba"],
           "position_embedding_type": "nope", "max_position_embeddings": 256}
# Nemotron-H without experts: Mamba-2 (2 groups, the norm per group in both), MLP-only relu²
# layers, NoPE attention
NEMOTRON = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
            "conv_kernel": 4, "chunk_size": 8, "hybrid_override_pattern": "M-M*-",
            "max_position_embeddings": 256}
CASES = {
    "granite-nope": {},
    # RoPE, Granite's multipliers away from 1, 2 Mamba groups (of B and C; the norm is whole)
    "granite-rope-scaled": {"position_embedding_type": "rope", "embedding_multiplier": 3.0,
                            "residual_multiplier": 0.5, "attention_multiplier": 0.4,
                            "logits_scaling": 2.5, "mamba_n_groups": 2},
}


def spread_mamba(folder, seed=0):
    """Weights far from the writer's defaults, so every tensor moves the logits: norms away
    from 1, A_log, D and dt_bias of order one, products of order-one activations."""
    gen = torch.Generator().manual_seed(seed)

    def change(tensors):
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("norm.weight"):
                tensors[name] = 1.0 + 0.3 * noise
            elif t.dim() == 1 or "embed" in name:  # A_log, D, dt_bias, conv1d.bias
                tensors[name] = noise
            else:
                gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                tensors[name] = gain * noise / t.shape[-1] ** 0.5
    edit_tensors(folder, change)


CASES["nemotron-dense"] = {}


def granite_checkpoint(tmp_path, case: str, **changes):
    """(Or Nemotron-H's, for "nemotron-dense".)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.NemotronHConfig(**{**NEMOTRON, **changes}) \
        if case.startswith("nemotron") else \
        transformers.GraniteMoeHybridConfig(**{**GRANITE, **CASES[case], **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / case
    model.save_pretrained(folder)
    spread_mamba(folder)
    if case == "granite-rope-scaled":  # transformers normalises y·silu(z) over the whole
        arch = ModelConfig.load(str(folder))  # width, vLLM (and the kit) per group: one here
        assert arch.recurrent.norm_groups == 2
    return folder


def whole_width_norm(folder):
    """The kit's model of `folder` with the gated norm over the whole width (transformers'
    Granite), where vLLM's groups it by mamba_n_groups."""
    arch = ModelConfig.load(str(folder))
    arch = dataclasses.replace(arch, recurrent=dataclasses.replace(arch.recurrent,
                                                                   norm_groups=1))
    return build_model(arch, "float32", "cpu")


def test_chunked_scan_is_the_recurrence():
    """The prefill's chunked scan (chunks of 4 over 11 positions) equals the step-by-step
    recurrence h = exp(dt·A)·h + dt·x⊗B, y = h·C, and its final state."""
    gen = torch.Generator().manual_seed(0)
    seqs, length, heads, p, n = 2, 11, 3, 4, 5
    x, b, c = (torch.randn(seqs, length, heads, d, generator=gen) for d in (p, n, n))
    dt = torch.rand(seqs, length, heads, generator=gen)
    a = -torch.rand(heads, generator=gen) - 0.5
    y, final = chunked_scan(x, dt, a, b, c, 4)
    h = torch.zeros(seqs, heads, p, n)
    for t in range(length):
        h = h * torch.exp(dt[:, t] * a)[..., None, None] + \
            (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        assert torch.allclose(y[:, t], (h * c[:, t, :, None, :]).sum(-1), atol=1e-5)
    assert torch.allclose(final, h, atol=1e-5)


def test_the_opaque_scan_is_the_chunked_scan_and_compiles_as_one_call():
    """The operator a compiled prefill calls (`opaque_chunked_scan`) gives `chunked_scan`'s
    exact results, its shapes agree with its fake (`torch.library.opcheck`), and a function
    compiled with the length symbolic holds one call to it, nothing of the scan inside, and
    serves lengths that are and are not multiples of the chunk without compiling again."""
    gen = torch.Generator().manual_seed(0)
    heads, p, n = 3, 4, 5

    def inputs(length):
        x, b, c = (torch.randn(2, length, heads, d, generator=gen) for d in (p, n, n))
        a = -torch.rand(heads, generator=gen) - 0.5
        return x, torch.rand(2, length, heads, generator=gen), a, b, c
    args = inputs(11)
    for got, want in zip(opaque_chunked_scan(*args, 4), chunked_scan(*args, 4)):
        assert torch.equal(got, want)
    torch.library.opcheck(opaque_chunked_scan, (*args, 4))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm
    scan = torch.compile(lambda *t: opaque_chunked_scan(*t, 4), backend=backend, fullgraph=True)
    for length in (11, 8, 13):
        args = inputs(length)
        if length == 11:  # the prompt length symbolic, as in the CPU's compiled prefill
            for t in (args[0], args[1], args[3], args[4]):
                torch._dynamo.mark_dynamic(t, 1)
        for got, want in zip(scan(*args), chunked_scan(*args, 4)):
            assert torch.equal(got, want)
    assert len(graphs) == 1
    assert graphs[0].count(torch.ops.kit.mamba2_chunked_scan.default) == 1, graphs[0]
    assert len(graphs[0]) <= 3, graphs[0]  # the call and the two outputs' getitems


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_match_transformers(tmp_path, case):
    folder = granite_checkpoint(tmp_path, case)
    ids = torch.randint(0, 1000, (3, 13), generator=torch.Generator().manual_seed(1))
    if CASES[case].get("mamba_n_groups", 1) > 1:
        model = whole_width_norm(folder)
        with torch.no_grad():
            got = model.compute_logits(model(ids))
            expected = reference_model(folder, torch.float32)(input_ids=ids).logits
    else:
        got, expected = kit_and_reference_logits(folder, ids)
    error = relative_error(got, expected)
    print(f"{case}: prefill max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"]


@pytest.mark.parametrize("case,strategy", [
    ("granite-nope", "eager"), ("granite-rope-scaled", "eager"), ("nemotron-dense", "eager"),
    pytest.param("granite-nope", "guard_free", marks=pytest.mark.slow)])  # compiles: ~40 s
def test_every_paged_decode_step_matches_transformers_and_the_no_cache_reference(
        tmp_path, case, strategy):
    """Prompts of 5, 8 and 11 tokens (11: two Mamba chunks), 6 greedy steps: every step's
    logits (the prefill's included) within float32's 1e-4 of transformers' forward over the
    prompt and the tokens fed back, and of the kit's own `no_cache_logits`."""
    folder = granite_checkpoint(tmp_path, case)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, strategy)
    own = check_against_no_cache(kit_model(folder), prompts, run, "float32")
    print(f"{case} {strategy}: against no_cache_logits {own.max_error:.2e}")
    assert own.ok and own.token_agreement == 1.0
    if CASES[case].get("mamba_n_groups", 1) > 1:
        return  # transformers' norm differs (whole width): compared on the prefill above
    reference = reference_model(folder, torch.float32)
    worst = paged_error(reference, prompts, run, 6)
    print(f"{case} {strategy}: paged decode, 6 steps, max |kit - transformers| / max |logit| "
          f"= {worst:.2e}")
    assert worst <= kit.config.TOLERANCE["float32"]


def test_the_decode_reads_the_state_slots(tmp_path):
    """A run whose states are disturbed after the prefill gives other logits: decode reads
    the slots the prefill wrote (one per sequence, its recurrent group's block), and nothing
    recomputes the context."""
    model = kit_model(granite_checkpoint(tmp_path, "granite-nope"))
    layout = KVCacheLayout.for_model(model.arch, 16, "float32")
    prompts = make_prompts([5, 8], model.arch.vocab_size, 3)
    clean = generate(model, batch_for_run(layout, [5, 8], 2, "cpu"), prompts, 2)
    batch = batch_for_run(layout, [5, 8], 2, "cpu")
    first = batch.start(model, prompts)
    slots = batch.block_tables[0, :, 0]  # group 0: layer 0's state
    assert batch.states.ssm[0, slots].abs().amax() > 0
    batch.states.ssm[0, slots] *= 1.5
    step = batch.step(step_function(model, batch.max_context_len))
    assert torch.allclose(first, clean.logits[0])
    assert relative_error(step, clean.logits[1]) > 1e-3


def test_each_part_moves_the_logits(tmp_path):
    """The parity is no accident: without the multipliers, or with RoPE where Granite has
    none, the kit's prefill is far from transformers'."""
    folder = granite_checkpoint(tmp_path, "granite-rope-scaled")
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference_model(folder, torch.float32)(input_ids=ids).logits
    arch = dataclasses.replace(whole_width_norm(folder).arch)
    for part in ("embedding_multiplier", "residual_multiplier", "attention_multiplier"):
        changed = dataclasses.replace(arch, hybrid=dataclasses.replace(arch.hybrid, **{part: 1.0}))
        model = build_model(changed, "float32", "cpu")
        with torch.no_grad():
            error = relative_error(model.compute_logits(model(ids)), expected)
        assert error > 100 * kit.config.TOLERANCE["float32"], part


@pytest.mark.parametrize("changes,message", [
    ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
    ({"mamba_expand": 3}, "Mamba heads"),
    ({"mamba_rms_norm": False}, "unknown keys \\['mamba_rms_norm'\\]"),
])
def test_what_the_decoder_does_not_build_is_refused_by_name(changes, message):
    arch = ModelConfig.from_dict({"model_type": "granitemoehybrid", **GRANITE, **changes}, "g")
    with pytest.raises(ConfigError, match=message):
        check_runnable(arch)


@pytest.mark.parametrize("changes,message", [
    ({"hybrid_override_pattern": "M-M*E", "n_routed_experts": 4,
      "moe_intermediate_size": 32}, "MoE layers"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"),
    ({"residual_in_fp32": True}, "residual_in_fp32"),
])
def test_nemotron_h_refuses_what_it_does_not_build_by_name(changes, message):
    hf = {"model_type": "nemotron_h", "mlp_hidden_act": "relu2", **NEMOTRON, **changes}
    with pytest.raises(ConfigError, match=message):
        check_runnable(ModelConfig.from_dict(hf, "n"))


@pytest.mark.vllm
# (granite-nope: 72 of 72 as well when measured; its NoPE engine starts in test_vllm's
# hybrid-specs test, and the scaled case's grouped norm and multipliers are the ones to check)
@pytest.mark.parametrize("case", ["granite-rope-scaled", "nemotron-dense"])
def test_vllm_generates_the_kits_tokens(tmp_path, case):
    """vLLM 0.32's CPU engine on the transformers-written checkpoint, float32, greedy: three
    prompts of 5, 30 and 41 tokens, 24 tokens each, every one the kit's (its paged decode);
    each token's log-probability within 1e-3. With 2 Mamba groups vLLM normalises per group,
    as the kit does (transformers' Granite does not)."""
    pytest.importorskip("vllm")
    from kit.vllm.greedy import greedy_from_checkpoint
    # (vLLM's CPU attention takes heads of 32 and more)
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    folder = granite_checkpoint(tmp_path, case, **heads, **(
        {"head_dim": 32} if case.startswith("nemotron") else {}))
    lengths, steps = [5, 30, 41], 23
    prompts, run = kit_paged_decode(folder, lengths, steps, "eager")
    vllm = greedy_from_checkpoint(folder, [p.tolist() for p in prompts], steps + 1)
    logprobs = torch.log_softmax(run.logits.float(), -1)
    worst = max(abs(logprobs[t, i, tok].item() - lp) for i, (toks, lps) in
                enumerate(zip(vllm.tokens, vllm.logprobs)) for t, (tok, lp) in
                enumerate(zip(toks, lps)))
    equal = sum(a == b for k, v in zip(run.tokens.tolist(), vllm.tokens) for a, b in zip(k, v))
    print(f"{case}: {equal} of {len(lengths) * (steps + 1)} tokens equal to vLLM's; "
          f"log-probabilities within {worst:.1e}")
    assert vllm.tokens == run.tokens.tolist()
    assert worst <= 1e-3
