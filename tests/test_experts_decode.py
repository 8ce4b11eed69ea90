"""Chapter 04 through experts: the experts each step picked (recorded), the bytes a step moves
from them, and every strategy's step on an MoE model against the eager one."""
import pytest
import torch

from kit.config import ModelConfig
from kit.engine.decode import batch_for_run, generate, make_prompts
from kit.engine.expert_picks import moe_layers, record_picks
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.layers.experts import distinct_experts
from kit.engine.model import build_model
from kit.engine.no_cache import check_against_no_cache
from kit.measure.roofline import decode_step_cost, weight_bytes_per_step
from kit.engine.kv_specs import attention_specs


def moe_arch(layers=2, experts=8, k=2, hidden=64, vocab=101):
    return ModelConfig.from_dict({
        "model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": 96,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": vocab, "max_position_embeddings": 256,
        "num_experts": experts, "num_experts_per_tok": k, "moe_intermediate_size": 32,
        "norm_topk_prob": True}, f"moe-{layers}-{experts}-{k}")


def run_of(a, prompts, steps=5, dtype="float32", block_size=4):
    model = build_model(a, dtype, "cpu", seed=0)
    layout = KVCacheLayout.for_model(a, block_size, dtype)
    batch = batch_for_run(layout, [len(p) for p in prompts], steps, "cpu")
    return model, batch


def test_step_bytes_from_the_experts_picked_by_hand():
    a = ModelConfig.from_dict({
        "model_type": "qwen3_moe", "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 4}, "hand-moe")
    # one expert: gate, up, down of 8×4 = 96; a layer's router 4×8 = 32, its 4 experts 384
    assert a.expert_weights() == 96
    every = weight_bytes_per_step(a, 2, 2)
    assert weight_bytes_per_step(a, 2, 2, (4, 4)) == every
    # layer 0 read 2 of its 4 experts, layer 1 read 3: 2 + 1 experts never read
    assert every - weight_bytes_per_step(a, 2, 2, (2, 3)) == 3 * 96 * 2
    specs = attention_specs((None, None), 16, 1, 4, 2)
    cost = decode_step_cost(a, 2, specs, [3, 5], (2, 3))
    assert cost.weight_bytes == every - 576 and cost.experts_read == (2, 3)
    # FLOPs from the active weights: per layer q 64 + k 32 + v 32 + o 64, router 32, 2 of the
    # 4 experts 192; LM head 80; attention 4 × 2 heads × head_dim 4 × 2 layers × (3 + 5)
    assert cost.flops == 2 * 2 * (2 * (192 + 32 + 192) + 80) + 4 * 2 * 4 * 2 * (3 + 5) == 4160
    with pytest.raises(ValueError, match="one count in 1..4 per MoE layer"):
        weight_bytes_per_step(a, 2, 2, (5, 1))


def test_a_batch_picking_the_same_experts_moves_fewer_bytes_than_one_spreading_them():
    """Four copies of one prompt route every step's tokens alike: k experts per layer; four
    different prompts spread over more, and their steps must move more bytes."""
    a = moe_arch()
    same = make_prompts([6], a.vocab_size, seed=3) * 4
    spread = make_prompts([6] * 4, a.vocab_size, seed=3)
    counts = {}
    for name, prompts in {"same": same, "spread": spread}.items():
        model, batch = run_of(a, prompts)
        picks, _ = record_picks(model, batch, prompts, 5)
        counts[name] = picks.counts()
    assert all(c == (2, 2) for c in counts["same"]), counts["same"]
    assert all(2 <= n <= 8 for c in counts["spread"] for n in c)
    assert sum(map(sum, counts["spread"])) > sum(map(sum, counts["same"]))
    bytes_of = {k: [weight_bytes_per_step(a, 4, 4, c) for c in v] for k, v in counts.items()}
    assert all(s <= p for s, p in zip(bytes_of["same"], bytes_of["spread"]))
    assert sum(bytes_of["same"]) < sum(bytes_of["spread"])


def test_the_recorder_sees_each_layers_routing_and_changes_nothing():
    a = moe_arch()
    prompts = make_prompts([3, 5, 9], a.vocab_size, seed=1)
    model, batch = run_of(a, prompts)
    plain = generate(model, batch, prompts, 5)
    seen = []  # each MoE layer's input, taken apart from the recorder to route it again
    hooks = [moe.register_forward_pre_hook(lambda m, args: seen.append((m, args[0])))
             for _, moe in moe_layers(model)]
    picks, recorded = record_picks(model, batch, prompts, 5, keep_logits=True)
    for h in hooks:
        h.remove()
    assert torch.equal(plain.logits, recorded.logits) and torch.equal(plain.tokens, recorded.tokens)
    assert len(picks.steps) == 5 and all(len(s) == 2 for s in picks.steps)
    steps = seen[-5 * 2:]  # the prefill's calls come first; then each step calls both layers
    expected = [distinct_experts(m.route(x)[1]) for m, x in steps]
    assert [n for c in picks.counts() for n in c] == expected
    assert len({s[0] for s in picks.steps}) > 1  # the routing varies step by step
    result = check_against_no_cache(model, prompts, recorded, "float32")
    assert result.ok, result.errors


@pytest.fixture(scope="module")
def moe_step():
    """One 1-layer MoE model, its batch and its eager run, shared by the three strategies'
    tests with one `CompiledGraphs`, as chapter 04 shares them: the strategies differ in how a
    call reaches the compiled code, not in the code, so the first test's runner compiles the
    frozen step (which Inductor's cache cannot hold) and the others take its graph, each still
    tracing it with Dynamo (fullgraph, its own guards). conftest's XDIST_GROUPS keeps the tests
    in one worker, which builds this once."""
    from kit.engine.runners import CompiledGraphs
    a = moe_arch(layers=1)
    prompts = make_prompts([3, 5, 9], a.vocab_size, seed=1)
    model, batch = run_of(a, prompts)
    picks, eager = record_picks(model, batch, prompts, 5, keep_logits=True)
    shared = CompiledGraphs()
    yield model, batch, prompts, picks, eager, shared
    shared.clear()


@pytest.mark.parametrize("strategy", ["stock", "guard_free", "bytecode_hook"])
def test_every_strategys_moe_step_equals_eager_with_one_graph(moe_step, strategy):
    """The compiled step through the router and grouped experts, its routing changing step by
    step, equals the eager step and the no-cache reference, with one graph (stock keeps its
    guards: a routing that recompiled would show; fullgraph=True: a break would raise)."""
    from kit.engine.decode_runners import decode_runner
    model, batch, prompts, picks, eager, shared = moe_step
    runner = decode_runner(model, batch, prompts, strategy, shared=shared)
    run = generate(model, batch, prompts, 5, step=runner)
    runner.discard()
    assert len(set(picks.steps[i][0] for i in range(5))) > 1
    assert runner.graphs_compiled == 1
    assert torch.equal(run.tokens, eager.tokens)
    assert (run.logits.float() - eager.logits.float()).abs().max() < 1e-4
    assert check_against_no_cache(model, prompts, run, "float32").ok


def test_routing_compiles_once_grouped_and_breaks_looped_on_the_host():
    from kit.studies.experts_by_batch import routing_under_dynamo
    grouped, looped = routing_under_dynamo(moe_arch(layers=1), "float32", tokens=3, calls=4)
    assert grouped.routings > 1
    assert (grouped.fullgraph, grouped.graphs, grouped.graph_breaks, grouped.recompiles) == \
        ("one graph", 1, 0, 0)
    assert looped.fullgraph.startswith("refused") and looped.graph_breaks > 0
    assert looped.graphs > 1


def test_the_reference_replays_a_16_bit_runs_routing_and_counts_its_flips():
    """In bf16 the paged run and the no-cache reference round differently, and where a router's
    k-th and (k+1)-th experts nearly tie they pick differently. The replayed reference routes
    as the run did: closer than the plain reference, every flip a near-tie within tolerance."""
    from kit.engine.routing_replay import check_routed_against_no_cache
    a = moe_arch(layers=2, experts=16, k=4)
    prompts = make_prompts([12, 20, 20, 7], a.vocab_size, seed=1)
    model, batch = run_of(a, prompts, steps=12, dtype="bfloat16", block_size=16)
    run = generate(model, batch, prompts, 12)
    plain = check_against_no_cache(model, prompts, run, "bfloat16")
    replayed = check_routed_against_no_cache(model, batch, prompts, run, "bfloat16")
    flips = replayed.routing
    assert flips.positions == 2 * (12 + 20 + 20 + 7 + 4 * 12)  # every position, both layers
    assert replayed.ok and replayed.max_error < plain.max_error
    assert flips.gaps and max(flips.gaps) <= flips.tolerance
    assert replayed.summary()["routing"]["flips"] == len(flips.gaps)


def test_a_routing_the_run_did_not_take_fails_the_replayed_check(monkeypatch):
    """The check can fail: replaying picks shifted to other experts makes the reference's own
    router disagree across wide gaps, which no rounding explains."""
    from kit.engine import routing_replay
    a = moe_arch(layers=2, experts=8, k=2)
    prompts = make_prompts([9, 9], a.vocab_size, seed=2)
    model, batch = run_of(a, prompts, steps=4)
    run = generate(model, batch, prompts, 4)
    record = routing_replay.record_routing
    good = routing_replay.check_routed_against_no_cache(model, batch, prompts, run, "float32")
    assert good.ok and good.routing.gaps == [] and good.max_error < 1e-5
    monkeypatch.setattr(routing_replay, "record_routing", lambda *args: [
        [(ids + 1) % a.num_experts for ids in seq] for seq in record(*args)])
    bad = routing_replay.check_routed_against_no_cache(model, batch, prompts, run, "float32")
    assert not bad.ok and not bad.routing.ok and max(bad.routing.gaps) > 1e-4


def test_the_other_side_of_a_near_tie():
    """A step a compiled run routed across a near-tie is tried with the other side: the top k
    with its k-th swapped for the (k+1)-th (or back to the top k), later layers routing as they
    then see (-1)."""
    from kit.engine.routing_replay import across, other_side
    top = torch.tensor([5, 2, 7])  # the reference's top k + 1, k = 2
    assert other_side(torch.tensor([2, 5]), top).tolist() == [5, 7]
    assert other_side(torch.tensor([5, 7]), top).tolist() == [5, 2]
    routing = [torch.zeros(3, 2, dtype=torch.long) for _ in range(3)]
    alt = across(routing, 1, 2, torch.tensor([5, 7]))
    assert alt[0].tolist() == routing[0].tolist() and alt[1][2].tolist() == [5, 7]
    assert alt[2][2].tolist() == [-1, -1] and alt[2][:2].eq(0).all()
    assert routing[1][2].tolist() == [0, 0]  # the recorded routing untouched


def test_the_summed_attention_run_passes_the_replayed_check_in_bf16():
    """The step compiled code runs (attention summed) rounds otherwise than the eager rerun the
    routing comes from; its 16-bit run must still pass, across whatever ties it took."""
    from kit.engine.layers.attention import summed_attention
    from kit.engine.routing_replay import check_routed_against_no_cache
    a = moe_arch(layers=2, experts=16, k=4)
    prompts = make_prompts([12, 20, 20, 7], a.vocab_size, seed=1)
    model, batch = run_of(a, prompts, steps=12, dtype="bfloat16", block_size=16)
    with summed_attention():
        run = generate(model, batch, prompts, 12)
    check = check_routed_against_no_cache(model, batch, prompts, run, "bfloat16")
    assert check.ok, (check.max_error, check.routing.summary())


def test_the_compiled_prefill_notes_the_picks_it_made():
    """`noting_picks` hears the CPU's compiled prefill as it hears eager code (an op of its own
    in the graph), each noted tensor a copy: compiled code reuses the buffers it frees, and a
    kept alias read the ones that came after (every pick noted as expert 1)."""
    from kit.engine.decode_runners import prefill_runner
    from kit.engine.layers.experts import noting_picks
    a = moe_arch(layers=2, experts=8, k=2)
    prompts = make_prompts([9, 9, 9], a.vocab_size, seed=3)
    model, batch = run_of(a, prompts)
    compiled = prefill_runner(model, batch, prompts)
    noted = {}
    for name, prefill in (("eager", None), ("compiled", compiled)):
        with noting_picks() as noted[name]:
            batch.start(model, prompts, prefill)
    compiled.discard()
    assert [layer for layer, _ in noted["compiled"]] == [0, 1]
    for (_, eager), (_, got) in zip(noted["eager"], noted["compiled"]):
        assert got.shape == (27, 2) and got.sort(-1).values.equal(eager.sort(-1).values)


def test_a_flips_gap_is_relative_to_the_largest_router_logit_in_magnitude():
    """A router's logits may all be negative. Relative to the top one (-0.008) the 0.005 gap
    between the 2nd and 3rd read 0.63 (tiny-gdn's chapter 04 failed on it); relative to the
    largest in magnitude (-0.5) it is 0.01, a near-tie."""
    from kit.engine.routing_replay import Flips, replayed
    a = moe_arch(layers=1, experts=8, k=2)
    model = build_model(a, "float32", "cpu", seed=0)
    moe = moe_layers(model)[0][1]
    logits = torch.tensor([-0.008, -0.016, -0.021, -0.108, -0.2, -0.3, -0.4, -0.5])
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = logits
    x = torch.zeros(1, a.hidden_size)
    x[0, 0] = 1.0
    flips = Flips(4e-2)
    replayed(moe, x, torch.tensor([[0, 2]]), flips, None)  # own picks: [0, 1]
    assert flips.gaps == [pytest.approx(0.005 / 0.5, rel=1e-4)] and flips.ok
