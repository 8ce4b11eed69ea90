"""The runners of each strategy (kit/engine/runners.py) and chapter 03's plans side by side
(kit/studies/compile_strategies.py)."""
import json

import pytest
import torch

from kit.cli.main import main
from kit.config import STRATEGIES, load
from kit.engine.runners import CompiledGraphs, make_runner
from kit.engine.serving_trace import decode_batch_sizes
from kit.errors import ConfigError
from kit.engine.model import build_model, dummy_batch
from kit.studies.compile_strategies import PLAN_NAMES, get_plans

BATCHES = (4, 1, 2, 3, 8, 5)


@pytest.fixture(scope="module")
def model():
    s = load("cpu-small", dtype="float32", device="cpu")
    return build_model(s.arch, s.dtype, "cpu", seed=0)


def ids(batch, seq_len=1, seed=0):
    return torch.randint(0, 32000, (batch, seq_len), generator=torch.Generator().manual_seed(seed + batch))


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("strategy", ["eager", "stock", "guard_free", "bytecode_hook"])
def test_outputs_match_eager_over_batch_sizes(model, strategy):
    runner = make_runner(model.forward, strategy, "cpu", (ids(4),))
    assert runner.compile_seconds > 0 and runner.capture_seconds == 0  # only cuda_graphs captures
    for b in BATCHES:
        torch.testing.assert_close(runner(ids(b)), model(ids(b)), atol=1e-4, rtol=1e-4)
    runner.discard()


def test_guard_free_compiles_once_and_keeps_no_guards_while_stock_recompiles(model):
    free = make_runner(model.forward, "guard_free", "cpu", (ids(4),))
    stock = make_runner(model.forward, "stock", "cpu", (ids(4),))
    for b in BATCHES:
        free(ids(b)), stock(ids(b))
    assert free.graphs_compiled == 1 and free.guards() == [0]
    # the contrast that shows the count can move: stock specializes batch 1 in a second graph
    assert stock.graphs_compiled == 2 and len(stock.guards()) == 2 and min(stock.guards()) > 0


def test_guard_free_turns_a_recompile_into_an_error(model):
    runner = make_runner(model.forward, "guard_free", "cpu", (ids(4),))
    torch._dynamo.eval_frame.remove_from_cache(runner.code)  # behind the runner's back
    with pytest.raises(RuntimeError, match="fail_on_recompile|recompil"):
        runner(ids(2))
    assert runner.graphs_compiled == 1


def test_runners_never_share_dynamo_caches(model):
    a = make_runner(model.forward, "stock", "cpu", (ids(4),))
    b = make_runner(model.forward, "guard_free", "cpu", (ids(4),))
    assert a.code is not b.code and a.code is not type(model).forward.__code__
    assert len(a.cache_entries()) == len(b.cache_entries()) == 1
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(type(model).forward.__code__) == []


def test_discarding_the_profiling_compile_leaves_what_serving_alone_leaves(model):
    profile_ids = dummy_batch(256, 8, 32000, "cpu")
    served_only = make_runner(model.forward, "stock", "cpu", (ids(4),))
    kept = make_runner(model.forward, "stock", "cpu", (profile_ids,))  # strategy 2
    discarded = make_runner(model.forward, "stock", "cpu", (profile_ids,))  # strategy 4
    discarded.discard()
    assert discarded.cache_entries() == []
    kept.warm((ids(4),))
    discarded.warm((ids(4),))
    assert discarded.guards() == served_only.guards()
    assert len(kept.cache_entries()) == len(served_only.cache_entries()) + 1


class MLP(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.up, self.down = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_strategies_sharing_compiled_graphs_compile_once_per_set_of_weights():
    """Runners given one CompiledGraphs: a second strategy on the same module takes the first's
    Inductor graph (its own Dynamo cache and guards still), while a module of the same shapes
    with other weights compiles its own, since freezing folds the weights into the graph."""
    first, other, x = MLP(0), MLP(1), torch.randn(4, 64)
    shared, frozen = CompiledGraphs(), {"freezing": True}
    stock = make_runner(first.forward, "stock", "cpu", (x,), inductor_config=frozen, shared=shared)
    free = make_runner(first.forward, "guard_free", "cpu", (x,), inductor_config=frozen,
                       shared=shared)
    own = make_runner(other.forward, "guard_free", "cpu", (x,), inductor_config=frozen,
                      shared=shared)
    assert (stock.reused_from, free.reused_from, own.reused_from) == (None, "stock", None)
    assert free.graphs[0] is stock.graphs[0] and own.graphs[0] is not stock.graphs[0]
    assert len(shared.graphs) == 2 and free.code is not stock.code
    assert free.guards() == [0] and stock.guards()[0] > 0
    for runner, module in ((stock, first), (free, first), (own, other)):
        torch.testing.assert_close(runner(x[:3]), module(x[:3]), atol=1e-5, rtol=1e-5)
    shared.clear()
    assert shared.graphs == {}


def test_bytecode_hook_runs_dynamos_code_without_dynamo(model):
    runner = make_runner(model.forward, "bytecode_hook", "cpu", (ids(4),))
    assert runner.dispatch is not None and runner.dispatch.__code__ is not runner.code
    for b in BATCHES:
        runner(ids(b))
    assert runner.graphs_compiled == 1 and len(runner.cache_entries()) == 1
    runner.discard()
    assert runner.dispatch is None


def test_direct_call_runs_the_same_graph(model):
    runner = make_runner(model.forward, "guard_free", "cpu", (ids(4),))
    (out,) = runner.direct_call(ids(3))()
    torch.testing.assert_close(out.view(3, 1, -1), runner(ids(3)))


def test_unknown_strategy_and_cuda_graphs_on_cpu_are_refused(model):
    with pytest.raises(ConfigError, match=r"unknown strategy 'inductor'.*'guard_free'"):
        make_runner(model.forward, "inductor", "cpu", (ids(4),))
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        make_runner(model.forward, "cuda_graphs", "cpu", (ids(4),))
    with pytest.raises(ConfigError, match="unknown plan"):
        get_plans(["eager", "fast"])
    assert set(STRATEGIES) <= {p.serve for p in get_plans()} | {"eager"}


def test_a_budget_the_eager_profile_fills_stops_the_comparison_before_any_compile():
    """tiny in float32 on cpu-small's 96 MiB: weights and the eager profile's activations leave
    no KV cache block (chapters 02 and 04 refuse it too), so chapter 03 says so, as a
    ConfigError, before compiling any plan (it ran every plan and ended in a TypeError)."""
    from torch._dynamo.utils import counters
    from kit.engine.kv_cache import KVCacheLayout
    from kit.studies.compile_strategies import compare
    settings = load("cpu-small", dtype="float32")
    graphs = counters["stats"]["unique_graphs"]
    with pytest.raises(ConfigError, match="No available memory for the cache blocks"):
        compare(settings, KVCacheLayout.for_settings(settings))
    assert counters["stats"]["unique_graphs"] == graphs


def test_decode_batch_sizes_visit_one_and_the_full_batch():
    for max_num_seqs in (1, 3, 8, 32, 256):
        for seed in range(20):
            sizes = decode_batch_sizes(max_num_seqs, seed=seed)
            assert sizes == decode_batch_sizes(max_num_seqs, seed=seed)  # deterministic
            assert sizes[0] == 1 and min(sizes) == 1 and max(sizes) == max_num_seqs
    assert len(set(decode_batch_sizes(8))) >= 5  # sizes between, not only the two ends


@pytest.mark.slow
def test_bench_command_prints_the_table_as_json(capsys):
    code = main(["bench", "compile", "-p", "max_num_batched_tokens=256", "--rounds", "2",
                 "--calls", "2", "--no-probe", "--plans", "profile_eager",
                 "profile_compiled_discard", "cuda_graphs"])
    table = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["name"] for r in table["plans"]] == [
        "profile_eager", "profile_compiled_discard", "cuda_graphs"]
    p3, p4, graphs = table["plans"]
    assert not graphs["available"] and "GPU" in graphs["reason"]
    assert p4["guards"] == p3["guards"] and p4["matches_eager"] and p3["matches_eager"]
    left = table["budget_bytes"] - table["weights_bytes"]
    bpb = table["bytes_per_block"]
    for r in (p3, p4):
        assert r["num_blocks"] == (left - r["peak_activation_bytes"]) // bpb
    assert set(PLAN_NAMES) >= {r["name"] for r in table["plans"]}


def test_a_sliding_family_compiles_to_the_eager_outputs():
    """Gemma 3's parts (sliding and full layers, QK-norm, two RoPE bases, sandwich norms) at a
    small shape, prompts of 12 tokens past a window of 5: one guard-free graph over batch
    sizes, as eager computes it."""
    from kit.config import ModelConfig
    arch = ModelConfig.from_dict({
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 101, "sliding_window": 5, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "layer_types": ["sliding_attention", "full_attention"]},
        "small-gemma3")
    small = build_model(arch, "float32", "cpu", seed=0)
    prompts = {b: torch.randint(0, 101, (b, 12), generator=torch.Generator().manual_seed(b))
               for b in (3, 2, 5)}
    runner = make_runner(small.forward, "guard_free", "cpu", (prompts[3],))
    for b, prompt in prompts.items():
        torch.testing.assert_close(runner(prompt), small(prompt), atol=1e-4, rtol=1e-4)
    assert runner.graphs_compiled == 1
    runner.discard()
