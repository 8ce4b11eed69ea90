"""Caches that are not K and V per head (issue 35, sizing): latent attention and recurrent
states laid out as vLLM 0.32 lays them out, checked against vLLM's own code on small configs
written by transformers (the published shapes are on tests/test_vllm.py's grid), on this CPU
and on the other kind of CPU (no AMX, no AVX-512 BF16: vLLM's probes and the kit's answer
alike); the runs refused by name; chapter 02's worked example of vLLM #40691."""
from __future__ import annotations

import itertools

import pytest
import torch

import kit
from kit.config import ModelConfig
from kit.engine import hybrid_cache
from kit.engine.kv_cache import KVCacheLayout, kv_cache_config
from kit.engine.kv_specs import MambaSpec, MLAAttentionSpec
from kit.errors import ConfigError
from kit.vllm.installed import vllm_missing
from kit.vllm.kv_sizing import vllm_kv_sizing_for_folder

needs_vllm = pytest.mark.skipif(bool(vllm_missing()), reason="vLLM is not installed")


def tiny_configs() -> dict:
    """One small config per family, as transformers' config classes write them."""
    import transformers as T
    common = dict(vocab_size=256, max_position_embeddings=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    return {
        "deepseek_v2": T.DeepseekV2Config(
            **{**common, "num_key_value_heads": 4}, hidden_size=256, intermediate_size=512,
            moe_intermediate_size=128, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, architectures=["DeepseekV2ForCausalLM"],
            torch_dtype="float32"),
        "granitemoehybrid": T.GraniteMoeHybridConfig(
            **common, hidden_size=128, intermediate_size=256, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=128, mamba_n_heads=8,
            mamba_d_head=32, mamba_d_state=64, mamba_n_groups=1,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            position_embedding_type="nope", architectures=["GraniteMoeHybridForCausalLM"],
            torch_dtype="float32"),
        "nemotron_h": T.NemotronHConfig(
            **common, hidden_size=256, intermediate_size=512, head_dim=64, mamba_num_heads=8,
            mamba_head_dim=32, ssm_state_size=64, n_groups=1, conv_kernel=4,
            hybrid_override_pattern="M-M*", architectures=["NemotronHForCausalLM"],
            torch_dtype="float32"),
        "qwen3_next": T.Qwen3NextConfig(
            **common, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            full_attention_interval=4, architectures=["Qwen3NextForCausalLM"],
            torch_dtype="bfloat16"),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-kinds")
    out = {}
    for family, config in tiny_configs().items():
        config.save_pretrained(root / family)
        out[family] = root / family
    return out


def kit_and_vllm(folder, block_size, dtype, cache_dtype, max_model_len=256, budget=2**26):
    """(the kit's numbers, vLLM's) for one small model on this CPU."""
    arch = ModelConfig.load(str(folder))
    layout = KVCacheLayout.for_model(arch, block_size, dtype, cache_dtype, device="cpu")
    config = kv_cache_config(layout, budget, max_model_len, "CPU", max_model_len)
    vllm = vllm_kv_sizing_for_folder(folder, budget, block_size=block_size,
                                     max_model_len=max_model_len, kv_cache_dtype=cache_dtype,
                                     dtype=dtype, max_num_batched_tokens=max_model_len)
    kit_side = (layout.block_size, config.num_blocks, config.log_line(),
                sorted(g.blocks_per_request(max_model_len, max_model_len) for g in layout.groups))
    return kit_side, (vllm.block_size if vllm.groups else None, vllm.num_blocks, vllm.log_line,
                      sorted(g.blocks_per_request for g in vllm.groups))


@needs_vllm
@pytest.mark.parametrize("family", ["deepseek_v2", "granitemoehybrid", "nemotron_h",
                                    "qwen3_next"])
def test_small_models_are_sized_as_vllm_sizes_them(folders, family):
    """Blocks, the attention block a hybrid runs at, tokens, concurrency and each group's
    blocks per request, for blocks 16 to 64, float32 and bf16, and fp8 caches."""
    for block_size, dtype, cache_dtype in itertools.product(
            (16, 64), ("float32", "bfloat16"), ("auto", "fp8")):
        kit_side, vllm = kit_and_vllm(folders[family], block_size, dtype, cache_dtype)
        assert kit_side[1:] == vllm[1:], (block_size, dtype, cache_dtype)


@needs_vllm
def test_the_kit_predicts_vllms_log_lines_for_a_hybrid(folders):
    """Granite's hybrid at block 32 in float32 on this CPU: vLLM logs that it sets the
    attention block to 160 tokens and pads the Mamba page; the kit says the same lines."""
    from kit.vllm.kv_sizing import engine_config
    from kit.vllm.log import captured_vllm_log
    from kit.vllm.model_specs import model_kv_specs
    records = []
    with captured_vllm_log(records):
        model_kv_specs(engine_config(folders["granitemoehybrid"], block_size=32,
                                     max_model_len=256, dtype="float32"))
    logged = [r.getMessage() for r in records if "mamba page size" in r.getMessage()]
    layout = KVCacheLayout.for_model(ModelConfig.load(str(folders["granitemoehybrid"])), 32,
                                     "float32", device="cpu")
    assert list(layout.notes) == logged and len(logged) == 2
    assert layout.block_size == 160 and "runs as 160" in layout.block_size_note()


@pytest.fixture
def other_cpu(monkeypatch):
    """A CPU without AMX and without AVX-512 BF16, for vLLM's probes and the kit's alike."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    hybrid_cache.cpu_traits.cache_clear()
    yield
    hybrid_cache.cpu_traits.cache_clear()


@needs_vllm
def test_on_a_cpu_without_amx_or_avx512_bf16_both_size_alike(folders, other_cpu):
    """There vLLM's latent attention takes its reference kernel's blocks of 16, whatever was
    asked, and keeps a bf16 model's SSM state in bf16 (not float32): the kit follows the probes."""
    kit_side, vllm = kit_and_vllm(folders["deepseek_v2"], 64, "bfloat16", "auto")
    assert kit_side == vllm and kit_side[0] == 16
    for family in ("granitemoehybrid", "qwen3_next"):
        kit_side, vllm = kit_and_vllm(folders[family], 32, "bfloat16", "auto")
        assert kit_side[1:] == vllm[1:], family
    arch = ModelConfig.load(str(folders["granitemoehybrid"]))
    state = KVCacheLayout.for_model(arch, 32, "bfloat16", device="cpu").specs[0]
    assert isinstance(state, MambaSpec) and state.state_bytes == (3 * 384 + 8 * 32 * 64) * 2


def test_the_specs_of_each_kind():
    """A latent is one head of kv_lora_rank + qk_rope_head_dim elements; a recurrent state
    costs no bytes per token and is kept twice (three times for Mamba-2) with prefix caching,
    once without; an MLP-only layer (Nemotron-H's) has no spec."""
    v3 = KVCacheLayout.for_model(ModelConfig.load("deepseek-v3"), 16, "bfloat16", device="cuda")
    assert {type(s) for s in v3.specs} == {MLAAttentionSpec}
    assert v3.bytes_per_token == 61 * 576 * 2
    nemotron = ModelConfig.load("nemotron-h-8b")
    for caching, states in ((True, 3), (False, 1)):
        layout = KVCacheLayout.for_model(nemotron, 16, "bfloat16", device="cuda",
                                         prefix_caching=caching)
        state = next(s for s in layout.specs if isinstance(s, MambaSpec))
        assert state.bytes_per_token == 0 and state.blocks_per_request(32768, 0) == states
        assert sum(len(g.layers) for g in layout.groups) == 28  # 24 Mamba-2 + 4 attention


def test_a_family_out_of_reach_is_refused_by_name_and_a_hybrid_sizes_for_a_run():
    """Every family the kit sizes runs now (none is sized only, issue 35), so the
    refusal shown is of a family it neither sizes nor runs, Falcon-H1 (by what it needs); Qwen3.5-27B's settings raise the block size to its hybrid page."""
    with pytest.raises(ConfigError, match="'falcon_h1' is not supported .it needs "
                                          "state-space or linear-attention layers"):
        ModelConfig.from_dict({"model_type": "falcon_h1", "hidden_size": 64}, "hybrid")
    settings = kit.load("cpu-small", sizing_only=True, model="qwen3.5-27b",
                        max_model_len=4096)
    assert KVCacheLayout.for_settings(settings).block_size > settings.block_size


def test_vllm_40691_is_reproduced_by_the_kits_layout():
    """Qwen3.5-27B on a GPU, prefix caching off: blocks of 784, 4 groups of 16 layers, 45
    blocks a request; 1,487 blocks give vLLM 0.19's logged 290,864 tokens and 33.04x."""
    from kit.studies.cache_kinds_lesson import issue_40691
    issue = issue_40691()
    assert (issue.layout.block_size, len(issue.layout.groups), issue.per_request) == (784, 4, 45)
    assert issue.num_blocks == 1487 and issue.old_tokens == 290_864
    assert f"{issue.concurrency:.2f}" == "33.04" and issue.new_tokens == 1_082_800


def test_the_torchvision_stand_in_is_only_a_placeholder(tmp_path):
    """Qwen3.5's folder needs it, others do not; any name taken from it fails when called."""
    from kit.vllm.stand_ins import HERE, needs_torchvision
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"]}')
    assert needs_torchvision(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    assert not needs_torchvision(tmp_path)
    import subprocess
    import sys
    code = ("import torchvision.io as io\ntry:\n    io.decode_image(b'')\nexcept RuntimeError as e:"
            "\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": HERE}, check=True).stdout
    assert "torchvision is not installed" in out


def test_a_gpu_refuses_more_sequences_than_recurrent_blocks():
    """vLLM #49064: on a GPU (full CUDA graphs of the decode) a hybrid needs num_blocks ≥
    max_num_seqs; the kit says vLLM's refusal, on the CPU it does not apply."""
    from kit.engine.kv_cache import too_few_states
    layout = KVCacheLayout.for_model(ModelConfig.load("qwen3.5-27b"), 16, "bfloat16",
                                     device="cuda")
    config = kv_cache_config(layout, 969 * layout.bytes_per_block, 131_072, "GPU", 8192)
    assert config.num_blocks == 969
    assert "max_num_seqs (1024) exceeds available Mamba cache blocks (969)" in \
        too_few_states(config, 1024, "cuda")
    assert too_few_states(config, 969, "cuda") is None and too_few_states(config, 1024, "cpu") is None
    dense = KVCacheLayout.for_model(ModelConfig.load("qwen3-0.6b"), 16, "bfloat16", device="cuda")
    assert too_few_states(kv_cache_config(dense, 2**30, 4096, "GPU", 8192), 10**6, "cuda") is None


@needs_vllm
@pytest.mark.parametrize("name", ["granite-4.0-h-small", "nemotron-h-8b", "qwen3-next-80b-a3b",
                                  "qwen3.5-27b", "qwen3.5-35b-a3b", "deepseek-v2-lite"])
def test_tensor_parallel_ranks_are_sized_as_vllm_sizes_them(tmp_path, name):
    """Over 2 and 4 ranks a recurrent state is split by heads (Mamba-2's groups extended to
    whole ones per rank: Granite's single group becomes one per rank) and a latent is kept
    whole on every rank; vLLM's per-rank shapes come from its model class."""
    from kit.config import MODELS_DIR
    (tmp_path / "config.json").write_text((MODELS_DIR / f"{name}.json").read_text())
    arch = ModelConfig.load(name)
    n = min(32_768, arch.max_position_embeddings)
    for tp in (2, 4):
        layout = KVCacheLayout.for_model(arch, 32, "bfloat16", "auto", tp, device="cpu")
        config = kv_cache_config(layout, 8 * 2**30, n, "CPU", 2048)
        vllm = vllm_kv_sizing_for_folder(tmp_path, 8 * 2**30, block_size=32, max_model_len=n,
                                         dtype="bfloat16", max_num_batched_tokens=2048,
                                         tensor_parallel_size=tp)
        assert (config.num_blocks, config.log_line()) == (vllm.num_blocks, vllm.log_line), tp
