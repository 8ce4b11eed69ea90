"""How a decode step reads its weights: from huge pages (`kit.engine.huge_pages`), and its
large dense products in the expert kernel (`Decoder.stream_products`); where each applies, and
that neither changes what the model computes beyond rounding."""
from pathlib import Path

import pytest
import torch
from torch import nn

from kit.config import ModelConfig, load
from kit.engine import huge_pages, model as model_module
from kit.engine.huge_pages import HUGE_PAGE, SMALLEST, huge_page_mode, on_huge_pages
from kit.engine.layers import linear as linear_module, product_choice
from kit.engine.model import build_model

SMAPS = Path("/proc/self/smaps")


def advised(pointer: int) -> bool:
    """Whether the mapping holding `pointer` is advised to use huge pages ("hg" in its
    VmFlags, /proc/self/smaps)."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= pointer < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"),
                                       ("[always] madvise never\n", "always"),
                                       ("always madvise [never]\n", "never"), ("", None)])
def test_the_kernels_mode_is_read_from_its_setting(tmp_path, monkeypatch, text, mode):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_page_mode() == mode
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert huge_page_mode() is None


@pytest.mark.skipif(huge_page_mode() not in ("always", "madvise") or not SMAPS.exists(),
                    reason="this kernel gives no transparent huge pages")
def test_large_weights_get_advised_memory_on_a_huge_page_boundary_and_small_ones_stay():
    layer = nn.Sequential(nn.Linear(1024, SMALLEST // 4096), nn.Linear(16, 16))
    small_before = layer[1].weight.data_ptr()
    assert on_huge_pages(layer) == SMALLEST
    big = layer[0].weight
    assert big.data_ptr() % HUGE_PAGE == 0 and advised(big.data_ptr())
    assert layer[1].weight.data_ptr() == small_before and not advised(small_before)
    big.data.fill_(2.0)  # the memory is the parameter's: written and read back through it
    assert layer[0](torch.ones(1, 1024)).eq(2048.0 + layer[0].bias).all()


def test_where_the_kernel_gives_none_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_page_mode", lambda: "never")
    layer = nn.Linear(1024, SMALLEST // 4096)
    before = layer.weight.data_ptr()
    assert on_huge_pages(layer) == 0 and layer.weight.data_ptr() == before


def test_a_model_built_on_huge_pages_has_the_same_weights(monkeypatch):
    """tiny's embedding (32,000 x 256 float32, 31 MiB) moves; every weight is drawn as before."""
    arch = load("cpu-small").arch
    placed = build_model(arch, "float32", "cpu", seed=3)
    monkeypatch.setattr(model_module, "on_huge_pages", lambda model: 0)
    plain = build_model(arch, "float32", "cpu", seed=3)
    for (name, a), b in zip(placed.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    if huge_page_mode() in ("always", "madvise"):
        assert placed.embed_tokens.weight.data_ptr() % HUGE_PAGE == 0


# One layer, 1,024 wide, its logits' weight 4,096 x 1,024 (16 MiB): the only one streamed
WIDE = ModelConfig.from_dict({
    "model_type": "llama", "hidden_size": 1024, "intermediate_size": 256, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096,
    "max_position_embeddings": 256}, "wide-llama")


def test_only_large_float32_weights_are_streamed():
    """`Decoder.stream_products`: in a step of at most FEW_ROWS rows, every float32 CPU weight of
    STREAMED_BYTES and rows of STREAMED_ROW or more is multiplied in the kernel where it was
    measured quicker here (WIDE's logits), the rest as before; 0 rows or more than FEW_ROWS,
    none; bf16 weights never."""
    model = build_model(WIDE, "float32", "cpu")
    model.stream_products(4)
    linears = [m for m in model.modules() if isinstance(m, linear_module.Linear)
               and m is not model.lm_head]  # (the logits' product reads `model.few_rows`)
    quicker = linear_module.library() is not None and \
        product_choice.measured_choice(4096, 1024, 4).kernel
    assert model.few_rows is quicker
    assert linears and not any(m.few_rows for m in linears)  # each under 16 MiB
    for rows in (0, linear_module.FEW_ROWS + 1):
        model.stream_products(rows)
        assert not model.few_rows
    bf16 = build_model(WIDE, "bfloat16", "cpu")
    bf16.stream_products(4)
    assert not bf16.few_rows


def test_the_quicker_way_is_measured_once_per_shape_and_both_ways_agree():
    """`product_choice`: oneDNN's packed product (as Inductor's frozen graph calls it) and the
    kernel, timed interleaved on this CPU; the kernel is chosen exactly when its quickest call
    took at most KERNEL_MARGIN of oneDNN's, a second ask reuses the first measurement, and
    both ways compute the product."""
    if linear_module.library() is None:
        pytest.skip("the kernel did not build here")
    choice = product_choice.measured_choice(2048, 1024, 3)
    assert choice.onednn_seconds > 0 and choice.kernel_seconds > 0 and choice.ratio > 0
    assert choice.kernel is (choice.ratio <= product_choice.KERNEL_MARGIN)
    assert product_choice.measured_choice(2048, 1024, 3) is choice
    assert choice in product_choice.measured_choices()
    assert choice.summary()["runs_in"] == ("kernel" if choice.kernel else "oneDNN")
    weight, x = torch.randn(2048, 1024), torch.randn(3, 1024)
    onednn = product_choice.library_product(x, weight, 3)()
    torch.testing.assert_close(linear_module.weight_products(x, weight), onednn, rtol=1e-5,
                               atol=1e-4)
    torch.testing.assert_close(onednn, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_compiled_a_streamed_product_runs_the_kernel_and_equals_f_linear():
    x, weight, bias = torch.randn(5, 1024), torch.randn(4096, 1024), torch.randn(4096)

    def step(x):
        return linear_module.linear(x, weight, bias, few_rows=True)

    from torch.profiler import profile
    compiled = torch.compile(step, fullgraph=True)
    compiled(x)
    with profile() as prof:
        got = compiled(x)
    calls = [e.key for e in prof.key_averages() if e.key == "kit::expert_products"]
    assert calls == ["kit::expert_products"]
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5,
                               atol=1e-4)  # (sums of 1,024 products, std 32, in another order)
    assert torch.equal(step(x), torch.nn.functional.linear(x, weight, bias))  # eager: F.linear


def test_a_compiled_decode_step_streams_its_logits_and_equals_the_reference(monkeypatch):
    """The decode runner of a batch of at most FEW_ROWS turns streaming on, here as on a CPU
    where the kernel was measured quicker at WIDE's logits (the product then runs in
    kit::expert_products), and the step's logits equal the no-cache reference; a prefill
    runner built after it turns it off."""
    from torch.profiler import profile
    from kit.engine.decode import batch_for_run, generate, make_prompts
    from kit.engine.decode_runners import decode_runner, prefill_runner
    from kit.engine.kv_cache import KVCacheLayout
    from kit.engine.no_cache import check_against_no_cache
    if linear_module.library() is None:
        pytest.skip("the kernel did not build here")
    threads = torch.get_num_threads()
    monkeypatch.setitem(product_choice._MEASURED, (4096, 1024, 3, threads),
                        product_choice.ProductChoice(4096, 1024, 3, threads, 2e-3, 1e-3, 0.5))
    model = build_model(WIDE, "float32", "cpu")
    batch = batch_for_run(KVCacheLayout.for_model(WIDE, 16, "float32"), [5, 9, 3], 4, "cpu", 3)
    prompts = make_prompts([5, 9, 3], WIDE.vocab_size, seed=1)
    runner = decode_runner(model, batch, prompts, "guard_free")
    assert model.few_rows
    with profile() as prof:
        batch.step(runner)
    assert "kit::expert_products" in {e.key for e in prof.key_averages()}
    run = generate(model, batch, prompts, 4, step=runner)
    assert check_against_no_cache(model, prompts, run, "float32").ok
    prefill_runner(model, batch, prompts)
    assert not model.few_rows
