"""DeepSeek-V2's multi-head latent attention run by the kit (issue 35): on checkpoints
transformers wrote (`DeepseekV2Config`, tiny shapes, float32), the prefill and every paged
decode step (the latent cached, decode in vLLM's absorbed form) against transformers' forward,
and against the kit's own no-cache reference; the cache holds one latent per token and layer."""
import dataclasses
import json

import pytest
import torch

import kit
from kit.config import ModelConfig
from kit.config.settings import check_runnable
from kit.engine.decode import batch_for_run, generate, make_prompts, step_function
from kit.engine.kv_cache import KVCacheLayout, allocate, layer_views
from kit.engine.model import build_model
from kit.engine.no_cache import check_against_no_cache
from kit.errors import ConfigError
from tests.test_checkpoint import (kit_and_reference_logits, kit_model, kit_paged_decode,
                                   paged_error, reference_model, relative_error, spread)

TINY = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "max_position_embeddings": 256}
# q_proj or the query's own low-rank pair (q_a_proj, q_a_layernorm, q_b_proj); greedy routing
# or 3 experts from the best of 2 groups (with groups of 4, often not greedy's 3), weights
# scaled; YaRN with DeepSeek's mscale on the scores (each one seen to move the logits by 0.16-0.65
# of the largest when left out)
CASES = {
    "mla-greedy": {},
    "mla-qlora-groups-yarn": {
        "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
}


def transformers_checkpoint(tmp_path, case: str, spread_weights: bool = True):
    """A folder transformers wrote (`from_config`, `save_pretrained`), its weights then spread
    so that every tensor moves the logits (`tests.test_checkpoint.spread`), or as written."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV2Config(**{**TINY, **CASES[case]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / case
    model.save_pretrained(folder)
    if spread_weights:
        spread(folder, gemma=False)
    return folder


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_match_transformers(tmp_path, case):
    folder = transformers_checkpoint(tmp_path, case)
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    got, expected = kit_and_reference_logits(folder, ids)
    error = relative_error(got, expected)
    print(f"{case}: prefill max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"]


@pytest.mark.parametrize("case,strategy", [
    *((case, "eager") for case in CASES),
    pytest.param("mla-qlora-groups-yarn", "guard_free", marks=pytest.mark.slow)])  # compiles
def test_every_paged_decode_step_matches_transformers_and_the_no_cache_reference(tmp_path,
                                                                                 case, strategy):
    """Prompts of 5, 8 and 11 tokens, 6 greedy steps, blocks of 4 (prompts end inside blocks,
    steps cross their edges): every step's logits (the prefill's included) within float32's
    1e-4 of transformers' forward over the prompt and the tokens fed back, and of the kit's
    own `no_cache_logits`."""
    folder = transformers_checkpoint(tmp_path, case)
    reference = reference_model(folder, torch.float32)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, strategy)
    worst = paged_error(reference, prompts, run, 6)
    print(f"{case} {strategy}: paged decode, 6 steps, max |kit - transformers| / max |logit| = "
          f"{worst:.2e}")
    assert worst <= kit.config.TOLERANCE["float32"]
    own = check_against_no_cache(kit_model(folder), prompts, run, "float32")
    print(f"{case}: against no_cache_logits {own.max_error:.2e}")
    assert own.ok and own.token_agreement == 1.0


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_paged_decode_within_the_kits_tolerance(tmp_path, case):
    """In bfloat16 on the weights as written (spread ones flip experts' picks in bf16): every
    step within the kit's bf16 tolerance of transformers in bf16 and of the kit's no-cache
    reference (seen: 7.0e-3 to 1.2e-2), every greedy token the reference's."""
    folder = transformers_checkpoint(tmp_path, case, spread_weights=False)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, "eager", "bfloat16")
    reference = reference_model(folder, torch.bfloat16)
    worst = paged_error(reference, prompts, run, 6)
    own = check_against_no_cache(kit_model(folder, "bfloat16"), prompts, run, "bfloat16")
    print(f"{case} bf16: against transformers {worst:.2e}, no_cache_logits {own.max_error:.2e}")
    assert worst <= kit.config.TOLERANCE["bfloat16"]
    assert own.ok and own.token_agreement == 1.0


@pytest.mark.parametrize("part", ["score_factor", "rope_scaling", "topk_method",
                                  "routed_scaling_factor"])
def test_each_part_moves_the_logits(tmp_path, part):
    """The parity above is no accident: without YaRN's mscale² on the scores, without YaRN,
    routing greedily or unscaled, the kit's prefill is far from transformers'."""
    folder = transformers_checkpoint(tmp_path, "mla-qlora-groups-yarn")
    arch = ModelConfig.load(str(folder))
    off = {"score_factor": 1.0, "topk_method": "greedy", "routed_scaling_factor": 1.0}
    arch = dataclasses.replace(arch, rope_scaling=()) if part == "rope_scaling" else \
        dataclasses.replace(arch, deepseek=dataclasses.replace(arch.deepseek,
                                                               **{part: off[part]}))
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference_model(folder, torch.float32)(input_ids=ids).logits
        model = build_model(arch, "float32", "cpu")
        got = model.compute_logits(model(ids))
    assert relative_error(got, expected) > 100 * kit.config.TOLERANCE["float32"]


def test_the_cache_holds_one_latent_per_token_and_layer(tmp_path):
    """vLLM's MLA layout: [layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim],
    each layer's view [num_blocks, block_size, 40], no K/V pair, no heads."""
    folder = transformers_checkpoint(tmp_path, "mla-greedy")
    arch = ModelConfig.load(str(folder))
    layout = KVCacheLayout.for_model(arch, 4, "float32")
    cache = allocate(layout, 7, "cpu")
    assert tuple(cache.shape) == (4, 7, 4, 40)
    assert [tuple(v.shape) for v in layer_views(cache, layout)] == [(7, 4, 40)] * 4
    assert layout.bytes_per_token == 4 * 40 * 4


def test_absorbed_decode_is_what_the_cache_holds(tmp_path):
    """The decode reads only the cache: a run whose cached latents are disturbed after the
    prefill gives other logits (the absorbed form does not recompute the context)."""
    model = kit_model(transformers_checkpoint(tmp_path, "mla-greedy"))
    layout = KVCacheLayout.for_model(model.arch, 4, "float32")
    prompts = make_prompts([5, 8], model.arch.vocab_size, 3)
    clean = generate(model, batch_for_run(layout, [5, 8], 2, "cpu"), prompts, 2)
    batch = batch_for_run(layout, [5, 8], 2, "cpu")
    first = batch.start(model, prompts)
    batch.kv_cache[:, 1:, :, :32] *= 1.5  # every cached c_kv, past the null block
    step = batch.step(step_function(model, batch.max_context_len))
    assert torch.allclose(first, clean.logits[0])
    assert relative_error(step, clean.logits[1]) > 1e-2


V3 = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 2, "topk_group": 1}


@pytest.mark.parametrize("family,changes,message", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' with scoring_func "
                                                  "'softmax' \\(deepseek_v2 routes 'greedy'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    ("deepseek_v2", {"attention_bias": True}, r"attention_bias=True \(built: False\)"),
    ("deepseek_v2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3},
     "n_group 3 and topk_group 1 for 8 experts"),
    # a misspelt key, and keys that would change the model (vLLM's use_mla switch, a layer
    # frequency transformers does not follow, transformers' rotary halves)
    ("deepseek_v2", {"moe_layer_fre": 1, "use_mla": False},
     r"keys it does not read: \['moe_layer_fre', 'use_mla'\]"),
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3", {**V3, "rope_interleave": False}, "rope_interleave=False"),
    ("deepseek_v3", {**V3, "tie_word_embeddings": True}, "tie_word_embeddings=True"),
    # V3 routes noaux_tc only, and config.json must say so (vLLM's defaults are V2's)
    ("deepseek_v3", {}, "topk_method None with scoring_func None .*write both"),
    ("deepseek_v3", {**V3, "topk_method": "greedy"}, "topk_method 'greedy'"),
    ("deepseek_v3", {**V3, "n_group": 8}, "n_group 8 and topk_group 1 for 8 experts"),
])
def test_what_the_decoder_does_not_build_is_refused_by_name(family, changes, message):
    """Every key read, inert or at the value built (`kit.config.deepseek`), else one line
    naming it before any work; sizing still takes the config (vLLM sizes it)."""
    arch = ModelConfig.from_dict({"model_type": family, **TINY, **changes}, "tiny")
    with pytest.raises(ConfigError, match=message):
        check_runnable(arch)
    assert json.loads(arch.source_config)["model_type"] == family


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "tiny-mla"])
def test_published_configs_run_checked(name):
    """The published configs' bookkeeping (auto_map, ep_size, aux_loss_alpha, seq_aux,
    num_nextn_predict_layers, ...) is known inert: they pass the run's checks."""
    check_runnable(ModelConfig.load(name))


def test_a_run_refuses_an_unknown_key_before_any_work_and_sizing_takes_it(tmp_path):
    """A user's config.json folder with a misspelt key: `kit.load` refuses the run by the key's
    name (no weights needed: the check reads config.json alone); sizing takes it."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v3", **TINY, **V3, "routed_scaling_factr": 2.5}))
    with pytest.raises(ConfigError, match="keys it does not read: \\['routed_scaling_factr'\\]"):
        kit.load("cpu-small", model=str(tmp_path), max_model_len=256)
    assert kit.load("cpu-small", sizing_only=True, model=str(tmp_path), max_model_len=256)
