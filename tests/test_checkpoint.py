"""Checkpoint folders: `python -m kit checkpoint` writes them, `model=<folder>` loads them, bad
folders are refused with the tensor or file named, and the kit's logits match transformers'
on checkpoints of every family."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kit
from kit.config import ModelConfig
from kit.engine.checkpoint import hf_shapes
from kit.engine.decode import batch_for_run, generate, make_prompts
from kit.engine.decode_runners import decode_runner
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.layers.attention import summed_attention
from kit.engine.model import build_model
from kit.errors import ConfigError
from kit.cli.new_checkpoint import write_random_checkpoint
from kit.cli.main import main

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "torch_dtype": "float32"}
# Each family's traits: grouped- and multi-query attention, head_dim unlike hidden / heads,
# tied and untied embeddings, QKV bias (qwen2), (1 + w) norms, sqrt(hidden) embedding scale
# and GELU-tanh (gemma), exact GELU (a llama configured with "gelu"); per-head QK-norm (qwen3,
# gemma3), sliding windows shorter than the prompts (mistral, gemma2, gemma3), soft-capped scores
# and logits, sandwich norms and query_pre_attn_scalar (gemma2), a local RoPE base (gemma3);
# experts picked by a softmax's top k, renormalised (mixtral) or not (qwen3_moe, beside a dense
# layer); gpt-oss's sinks, biased output projection, router and experts (a top k's softmax, the
# clamped SwiGLU at a limit and gain that bite), windows on every other layer and YaRN.
CASES = {
    "llama-gqa": {},
    "llama-mqa-tied-gelu": {"num_key_value_heads": 1, "head_dim": 16, "hidden_act": "gelu",
                            "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "hidden_size": 96, "num_attention_heads": 6,
                "head_dim": 16, "rope_theta": 10000.0},
    "qwen2-bias-tied": {"model_type": "qwen2", "rope_theta": 1e6, "tie_word_embeddings": True,
                        "rms_norm_eps": 1e-6},
    "llama3-rope-scaling": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32}},
    "gemma-mqa": {"model_type": "gemma", "hidden_size": 128, "num_key_value_heads": 1,
                  "head_dim": 48, "hidden_act": "gelu", "tie_word_embeddings": True,
                  "num_hidden_layers": 3},
    "qwen3-qk-norm": {"model_type": "qwen3", "rope_theta": 1e6, "rms_norm_eps": 1e-6},
    "mistral-window": {"model_type": "mistral", "sliding_window": 8, "rope_theta": 10000.0},
    "gemma2-window-softcap": {
        "model_type": "gemma2", "hidden_size": 128, "head_dim": 48, "hidden_act": "gelu",
        "tie_word_embeddings": True, "num_hidden_layers": 3, "sliding_window": 8,
        "query_pre_attn_scalar": 32, "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 30.0},
    "gemma3-window-qk-norm": {
        "model_type": "gemma3_text", "hidden_size": 128, "head_dim": 48, "hidden_act": "gelu",
        "tie_word_embeddings": True, "num_hidden_layers": 3, "sliding_window": 8,
        "query_pre_attn_scalar": 32, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "qwen3-moe-dense-layer": {"model_type": "qwen3_moe", "num_hidden_layers": 3,
                              "rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 3,
                              "moe_intermediate_size": 48, "mlp_only_layers": [1]},
    "mixtral-window": {"model_type": "mixtral", "sliding_window": 8, "num_local_experts": 4,
                       "num_experts_per_tok": 2, "rope_theta": 1e6},
    "gpt-oss-sinks-window-yarn": {
        "model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
        "swiglu_limit": 1.5, "swiglu_alpha": 1.2, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 16}},
    # Llama 4: chunks of 8 on the RoPE layers (0-2), layer 3 NoPE with its queries' temperature
    # tuned from position 3 on (floor_scale 4), MoE layers 1 and 3 (top 2 of 4 by sigmoid,
    # inputs scaled, a shared expert) beside dense ones of another width, q and k L2-normed,
    # Llama 3's RoPE scaling; prompts and steps cross chunk edges
    "llama4-chunked-nope-moe": {
        "model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 8,
        "interleave_moe_layer_step": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size_mlp": 128, "floor_scale": 4, "attn_scale": 0.5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
}
# Cases with sliding or chunked layers, run on prompts several windows (chunks) long.
WINDOWED = [case for case, changes in CASES.items()
            if "sliding_window" in changes or "attention_chunk_size" in changes]


def is_gemma(case: str) -> bool:
    return CASES[case].get("model_type", "").startswith("gemma")


def prompt_ids(case: str) -> torch.Tensor:
    """3 prompts of 11 tokens, or of 33 (over four windows) for a case with sliding layers."""
    length = 33 if case in WINDOWED else 11
    return torch.randint(0, 1000, (3, length), generator=torch.Generator().manual_seed(1))


def config_file(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **changes}))
    return path


def checkpoint(tmp_path, seed=0, dtype="float32", **changes):
    return write_random_checkpoint(str(config_file(tmp_path, **changes)), tmp_path / "ckpt",
                                   seed, dtype)


def kit_model(folder, dtype="float32"):
    return build_model(ModelConfig.load(str(folder)), dtype, "cpu")


def edit_tensors(folder, change):
    """Rewrite the folder's model.safetensors with `change(tensors)` applied."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def spread(folder, gemma: bool, seed=0):
    """Weights far from the writer's defaults, so that every tensor moves the logits: norms
    away from 1 (from 0 for Gemma's offsets), non-zero biases, attention scores well above 1
    (a wrong rotary layout or scale shows), activations of order one."""
    gen = torch.Generator().manual_seed(seed)

    def change(tensors):
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("norm.weight"):
                tensors[name] = (0.0 if gemma else 1.0) + 0.3 * noise
            elif name.endswith(("bias", "sinks")) or "embed" in name:
                tensors[name] = noise
            else:
                gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                tensors[name] = gain * noise / t.shape[1] ** 0.5
    edit_tensors(folder, change)


def test_writes_what_hugging_face_names(tmp_path):
    folder = checkpoint(tmp_path, model_type="qwen2", tie_word_embeddings=True)
    names = set(load_file(folder / "model.safetensors"))
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.self_attn.k_proj.bias", "model.layers.1.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= names
    assert "lm_head.weight" not in names  # tied: the embedding is written once
    assert names == set(hf_shapes(ModelConfig.load(str(folder))))
    assert json.loads((folder / "config.json").read_text())["architectures"] == \
        ["Qwen2ForCausalLM"]


def test_folder_loads_the_weights_the_seed_drew(tmp_path):
    folder = checkpoint(tmp_path, seed=3)
    settings = kit.load(model=str(folder), device="cpu", dtype="auto")
    assert settings.arch.checkpoint == str(folder.resolve()) and settings.dtype == "float32"
    loaded = build_model(settings.arch, "float32", "cpu", seed=99)  # the seed is not used
    drawn = build_model(ModelConfig.load(str(tmp_path / "config.json")), "float32", "cpu", 3)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), drawn.state_dict().items()):
        assert torch.equal(a, b), name
    assert kit_model(folder, "bfloat16").layers[0].mlp.gate_up_proj.weight.dtype == \
        torch.bfloat16


def test_other_safetensors_beside_model_safetensors_are_not_read(tmp_path):
    """Mistral's repositories hold consolidated.safetensors (other names) beside it."""
    folder = checkpoint(tmp_path)
    save_file({"tok_embeddings.weight": torch.zeros(2)}, folder / "consolidated.safetensors")
    assert ModelConfig.load(str(folder)).checkpoint and kit_model(folder) is not None


def test_a_bare_config_json_keeps_random_weights(tmp_path):
    checkpoint(tmp_path)
    assert ModelConfig.load(str(tmp_path / "ckpt" / "config.json")).checkpoint is None


def test_shards_named_by_the_index_load_the_same_weights(tmp_path):
    folder = checkpoint(tmp_path)
    whole = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(whole)
    shards = {"model-00001-of-00002.safetensors": names[:7],
              "model-00002-of-00002.safetensors": names[7:]}
    for file, part in shards.items():
        save_file({n: whole[n] for n in part}, folder / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = kit_model(folder)
    assert torch.equal(model.embed_tokens.weight, whole["model.embed_tokens.weight"])
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00002"):
        ModelConfig.load(str(folder))
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="weight_map"):
        ModelConfig.load(str(folder))


def test_pickle_weights_are_refused_never_read(tmp_path):
    config_file(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ConfigError, match="(?s)pytorch_model.bin.*safetensors.*save_pretrained"):
        ModelConfig.load(str(tmp_path))


def test_folder_without_config_json_or_of_an_unknown_family(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.load(str(tmp_path))
    folder = checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    with pytest.raises(ConfigError, match="phi3"):
        ModelConfig.load(str(folder))


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    folder = checkpoint(tmp_path)

    def change(tensors):
        del tensors["model.layers.1.mlp.down_proj.weight"]
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
        tensors["model.norm.weight"] = torch.ones(63)
    edit_tensors(folder, change)
    with pytest.raises(ConfigError) as err:
        kit_model(folder)
    for part in ("missing ['model.layers.1.mlp.down_proj.weight']",
                 "unexpected ['model.layers.0.self_attn.q_proj.bias']",
                 "model.norm.weight has shape (63,), expected (64,)"):
        assert part in str(err.value)


def test_truncated_file_is_refused(tmp_path):
    folder = checkpoint(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match="truncated or damaged"):
        kit_model(folder)


def test_tensors_that_cannot_be_cast_are_refused(tmp_path):
    folder = checkpoint(tmp_path)
    ints = torch.ones(64, dtype=torch.int64)
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": ints}))
    with pytest.raises(ConfigError, match="model.norm.weight is I64"):
        kit_model(folder)
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.full((64,), 1e6)}))
    with pytest.raises(ConfigError, match="model.norm.weight overflows torch.float16"):
        kit_model(folder, "float16")


def test_the_command_writes_a_folder_and_refuses_to_overwrite(tmp_path, capsys):
    config = str(config_file(tmp_path))
    assert main(["checkpoint", config, "--out", str(tmp_path / "a"), "--dtype", "bf16"]) == 0
    assert str(tmp_path / "a") in capsys.readouterr().out
    assert kit.load(model=str(tmp_path / "a"), device="cpu").dtype == "bfloat16"
    assert main(["checkpoint", config, "--out", str(tmp_path / "a")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def reference_model(folder, dtype):
    """transformers' model of the folder, its attention written out ("eager"), as the kit's
    capped scores are."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                             attn_implementation="eager")


def kit_and_reference_logits(folder, ids):
    reference = reference_model(folder, torch.float32)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    model = kit_model(folder)
    return model.compute_logits(model(ids)), expected


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_match_transformers(tmp_path, case):
    """Prefill of 3 prompts of 11 tokens (33 past a window); float32 within 1e-4 of the
    largest logit."""
    folder = checkpoint(tmp_path, **CASES[case])
    spread(folder, gemma=is_gemma(case))
    ids = prompt_ids(case)
    got, expected = kit_and_reference_logits(folder, ids)
    error = relative_error(got, expected)
    print(f"{case}: max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"], case


def test_the_parity_test_notices_one_wrong_weight(tmp_path):
    """The comparison is sensitive: one layer norm off by 1% moves the logits beyond it."""
    folder = checkpoint(tmp_path)
    spread(folder, gemma=False)
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    edit_tensors(folder, lambda t: t["model.layers.1.input_layernorm.weight"].mul_(1.01))
    got, _ = kit_and_reference_logits(folder, ids)
    edit_tensors(folder, lambda t: t["model.layers.1.input_layernorm.weight"].div_(1.01))
    _, expected = kit_and_reference_logits(folder, ids)
    assert relative_error(got, expected) > 10 * kit.config.TOLERANCE["float32"]


def kit_paged_decode(folder, lengths, steps, strategy, dtype="float32"):
    """The kit's paged decode of prompts of `lengths` (block size 4, so prompts end inside
    blocks and steps cross block edges) through `strategy`'s runner of the step; -> the
    prompts and the run (every step's logits and tokens)."""
    model = kit_model(folder, dtype)
    layout = KVCacheLayout.for_model(model.arch, 4, dtype)
    prompts = make_prompts(lengths, model.arch.vocab_size, 3)
    batch = batch_for_run(layout, lengths, steps, "cpu")
    if strategy == "eager_summed":  # eagerly, the attention summed as compiled code sums it
        with summed_attention():
            return prompts, generate(model, batch, prompts, steps)
    runner = None if strategy == "eager" else decode_runner(model, batch, prompts, strategy)
    run = generate(model, batch, prompts, steps, step=runner)
    if runner is not None:
        runner.discard()
    return prompts, run


def paged_error(reference, prompts, run, steps: int) -> float:
    """The largest error of a paged run (every step, the prefill's included) against
    `reference`'s forward (transformers) over each prompt and the tokens the run fed back,
    relative to the largest logit."""
    worst = 0.0
    for i, prompt in enumerate(prompts):
        ids = torch.cat([prompt, run.tokens[i, :steps]])[None]
        with torch.no_grad():
            expected = reference(input_ids=ids).logits[0, len(prompt) - 1:].float()
        worst = max(worst, relative_error(run.logits[:, i].float(), expected))
    return worst


def decode_error(folder, case, strategy, dtype="float32") -> float:
    """The largest error of the kit's paged decode (every step, prefill included) against
    transformers' forward over each prompt and the tokens fed back, in `dtype`, relative to
    the largest logit. Prompts of 5, 8 and 11 tokens; 5, 30 and 37 (past several windows) for a
    case with sliding layers."""
    reference = reference_model(folder, getattr(torch, dtype))
    lengths, steps = [5, 30, 37] if case in WINDOWED else [5, 8, 11], 6
    prompts, run = kit_paged_decode(folder, lengths, steps, strategy, dtype)
    worst = paged_error(reference, prompts, run, steps)
    print(f"{case} {strategy} {dtype}: {steps} steps, max |kit - transformers| / max |logit| "
          f"= {worst:.2e}")
    return worst


@pytest.mark.parametrize("case,strategy", [
    *((case, "eager") for case in CASES), ("gemma-mqa", "eager_summed"),
    ("gemma2-window-softcap", "eager_summed"), ("gpt-oss-sinks-window-yarn", "eager_summed"),
    ("llama4-chunked-nope-moe", "eager_summed"),
    pytest.param("llama-gqa", "guard_free", marks=pytest.mark.slow),  # compiles: ~10 s
    pytest.param("gpt-oss-sinks-window-yarn", "guard_free", marks=pytest.mark.slow),
    pytest.param("llama4-chunked-nope-moe", "guard_free", marks=pytest.mark.slow)])
def test_paged_decode_logits_match_transformers(tmp_path, case, strategy):
    """Every decode step's logits (prefill included) against transformers', float32 within
    1e-4 of the largest logit: the eager step (attention as two matmuls) and a compiled one
    (attention as summed products)."""
    folder = checkpoint(tmp_path, **CASES[case])
    spread(folder, gemma=is_gemma(case))
    worst = decode_error(folder, case, strategy)
    assert worst <= kit.config.TOLERANCE["float32"], (case, strategy, worst)


@pytest.mark.parametrize("case", WINDOWED + ["qwen3-qk-norm"])
def test_bfloat16_paged_decode_within_the_kits_tolerance(tmp_path, case):
    """The new families' paged decode in bfloat16 against transformers in bfloat16, on the
    checkpoint as written: within the kit's bf16 tolerance of the largest logit."""
    worst = decode_error(checkpoint(tmp_path, **CASES[case]), case, "eager", "bfloat16")
    assert worst <= kit.config.TOLERANCE["bfloat16"], (case, worst)


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_prefill_logits_within_the_kits_tolerance(tmp_path, case):
    """The kit in bfloat16 against transformers in bfloat16 on the checkpoint as written (the
    weights the chapters run): within the kit's bf16 tolerance of the largest logit; and the
    kit's bf16 rounding no worse than transformers' own, both against float32 (seen: 3-7e-3
    for both; with `spread`'s sharper weights both reach 4-7e-2)."""
    folder = checkpoint(tmp_path, **CASES[case])
    ids = prompt_ids(case)
    with torch.no_grad():
        exact, rounded = (reference_model(folder, dtype)(input_ids=ids).logits.float()
                          for dtype in (torch.float32, torch.bfloat16))
        model = kit_model(folder, "bfloat16")
        got = model.compute_logits(model(ids)).float()
    print(f"{case} bf16: kit vs transformers {relative_error(got, rounded):.2e}; against "
          f"float32: kit {relative_error(got, exact):.2e}, transformers "
          f"{relative_error(rounded, exact):.2e}")
    assert relative_error(got, rounded) <= kit.config.TOLERANCE["bfloat16"], case
    assert relative_error(got, exact) <= 1.5 * relative_error(rounded, exact), case


def test_token_comparison_allows_16_bit_runs_to_part_only_at_a_low_margin():
    from kit.studies.token_for_token import TokenComparison, TokenStep

    def steps(tokens, margins):
        return [TokenStep(0, t, kit, vllm, None, -1.0, m)
                for t, ((kit, vllm), m) in enumerate(zip(tokens, margins))]
    parted_late = steps([(1, 1), (2, 2), (3, 4), (5, 6)], [0.5, 0.3, 0.01, 0.2])
    assert TokenComparison("bfloat16", "f", parted_late).ok  # parted at a margin under 4e-2
    assert TokenComparison("bfloat16", "f", parted_late).first_low_margin(0) == 2
    assert TokenComparison("bfloat16", "f", parted_late).checked == 2  # steps 0 and 1
    assert TokenComparison("float32", "f", parted_late).checked == 4
    assert not TokenComparison("float32", "f", parted_late).ok  # float32: every token
    parted_early = steps([(1, 1), (2, 3), (3, 3)], [0.5, 0.3, 0.01])
    assert not TokenComparison("bfloat16", "f", parted_early).ok  # a wide margin, yet parted
    assert TokenComparison("float32", "f", steps([(1, 1)], [0.0])).agreement == 1.0


def test_llama3_rope_scaling_matters_and_other_kinds_are_refused(tmp_path):
    """Without its RoPE scaling a Llama 3 checkpoint's logits leave the tolerance (the kit
    used to ignore it); scaling kinds the kit lacks are refused, not ignored."""
    case = CASES["llama3-rope-scaling"]
    folder = checkpoint(tmp_path, **case)
    spread(folder, gemma=False)
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    scaled, expected = kit_and_reference_logits(folder, ids)
    unscaled = build_model(dataclasses.replace(ModelConfig.load(str(folder)), rope_scaling=()),
                           "float32", "cpu")
    assert relative_error(scaled, expected) <= kit.config.TOLERANCE["float32"]
    assert relative_error(unscaled.compute_logits(unscaled(ids)), expected) > 1e-3
    with pytest.raises(ConfigError, match="'longrope' is not supported"):
        ModelConfig.load(str(config_file(tmp_path, rope_scaling={"rope_type": "longrope",
                                                                 "factor": 4.0})))


def test_each_gpt_oss_part_moves_the_logits(tmp_path):
    """The gpt-oss case's parity is not blind to its parts: without the sinks, the output
    projection's bias, the experts' biases, the SwiGLU's clamp or YaRN's attention factor,
    the kit's logits leave the float32 tolerance by far."""
    folder = checkpoint(tmp_path, **CASES["gpt-oss-sinks-window-yarn"])
    spread(folder, gemma=False)
    ids = prompt_ids("gpt-oss-sinks-window-yarn")
    got, expected = kit_and_reference_logits(folder, ids)
    assert relative_error(got, expected) <= kit.config.TOLERANCE["float32"]
    model = kit_model(folder)
    attn, experts = model.layers[1].self_attn, model.layers[1].mlp.experts
    arch = model.arch
    scaling = dict(arch.rope_scaling)
    changes = {"sinks": lambda: attn.sinks.fill_(float("-inf")),
               "o_proj bias": lambda: attn.o_proj.bias.zero_(),
               "expert biases": lambda: experts.down_proj_bias.zero_(),
               "clamp": lambda: setattr(experts, "limit", 100.0),
               "yarn factor": lambda: setattr(model, "arch", dataclasses.replace(
                   arch, rope_scaling=tuple({**scaling, "attention_factor": 1.0}.items())))}
    for part, change in changes.items():
        model = kit_model(folder)
        attn, experts = model.layers[1].self_attn, model.layers[1].mlp.experts
        with torch.no_grad():
            change()
            error = relative_error(model.compute_logits(model(ids)), expected)
        assert error > 1e-3, (part, error)


def test_gpt_oss_keys_are_checked_and_a_quantized_config_refused(tmp_path):
    case = CASES["gpt-oss-sinks-window-yarn"]
    with pytest.raises(ConfigError, match="experts_per_token=3 differs from num_experts_per_tok"):
        ModelConfig.load(str(config_file(tmp_path, **{**case, "experts_per_token": 3})))
    with pytest.raises(ConfigError, match="(?s)quantization_config .*'mxfp4'.*unquantized.*drop"):
        ModelConfig.load(str(config_file(tmp_path, **case,
                                         quantization_config={"quant_method": "mxfp4"})))
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        ModelConfig.load(str(config_file(tmp_path, **case, decoder_sparse_step=2)))
    bare = {k: v for k, v in case.items() if k not in ("rope_scaling", "rope_theta",
                                                       "swiglu_limit", "swiglu_alpha")}
    arch = ModelConfig.load(str(config_file(tmp_path, **bare, initial_context_length=4096)))
    # GptOssConfig's defaults: YaRN x32 over 4,096 positions, the clamp at 7 and gain 1.702
    assert dict(arch.rope_scaling)["factor"] == 32.0 and arch.rope_theta == 500000.0  # given
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (7.0, 1.702)
    assert [arch.window(i) for i in range(4)] == [8, None, 8, None]


def test_a_token_comparison_vllm_could_not_run_is_recorded_not_raised():
    from kit.show.tables import token_table
    from kit.studies.token_for_token import TokenComparison, texts
    failed = TokenComparison("float32", "nowhere", error="ValueError: float32 not supported")
    assert not failed.ok and failed.agreement == 0.0 and texts(failed) is None
    assert failed.summary()["error"].startswith("ValueError")
    assert "float32 not supported" in repr(token_table({"float32": failed}))


def test_a_gated_delta_net_is_compared_with_vllms_cpu_engine_in_bf16_only():
    """vLLM's CPU delta-net asserts "CPU GDN attention requires BF16": chapter 05 leaves its
    float32 row out, saying why in the table, rather than failing the check."""
    from kit.show.tables import token_table
    from kit.studies.token_for_token import token_dtypes
    assert token_dtypes(kit.load(model="tiny-mamba")) == (["bfloat16", "float32"], {})
    dtypes, left_out = token_dtypes(kit.load(model="tiny-gdn"))
    assert dtypes == ["bfloat16"] and list(left_out) == ["float32"]
    assert "bf16 only" in repr(token_table({}, left_out))
    assert token_dtypes(kit.load(model="tiny-gdn", dtype="float32"))[0] == []


@pytest.mark.parametrize("family,changes", [
    ("gemma2", {"sliding_window": 8}), ("gemma3_text", {"sliding_window": 8}),
    ("mistral", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {}), ("gemma", {})])
def test_transformers_reads_the_written_config_as_the_kit_does(family, changes):
    """Where a family's config class has defaults of its own (Gemma 2's caps, 256 for
    query_pre_attn_scalar, Mistral's window of 4096, Gemma 3's local RoPE base), the config
    the kit writes still describes the kit's model: unset keys are written as null."""
    transformers = pytest.importorskip("transformers")
    arch = ModelConfig.from_dict({**SMALL, "model_type": family, **changes}, family)
    hf = transformers.AutoConfig.for_model(**arch.hf_dict())
    rope = hf.rope_parameters.get("sliding_attention", hf.rope_parameters)["rope_theta"]
    assert (getattr(hf, "hidden_activation", None) or hf.hidden_act) == arch.hidden_act
    assert (getattr(hf, "query_pre_attn_scalar", None) or hf.head_dim) ** -0.5 == \
        arch.attention_scale
    assert getattr(hf, "attn_logit_softcapping", None) == arch.attn_logit_softcapping
    assert getattr(hf, "final_logit_softcapping", None) == arch.final_logit_softcapping
    assert getattr(hf, "sliding_window", None) == arch.sliding_window
    assert list(getattr(hf, "layer_types", None) or arch.layer_types) == list(arch.layer_types)
    assert rope == arch.layer_rope_theta(0)


# Gemma 4's text decoder as transformers builds it (Gemma4TextConfig's keywords): the last 2 of
# 6 layers KV-shared (layer 4 reads layer 3's cache, layer 5 layer 2's), full layers with K = V
# and 1 KV head of 128 beside the sliding layers' 2 of 64 (the same bytes per token: one block
# size; GEMMA4_WIDE below has two), per-layer embeddings, the shared layers'
# MLPs doubled, proportional RoPE on full layers, capped logits, a window of 8.
GEMMA4 = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "global_head_dim": 128, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
          "vocab_size_per_layer_input": 1000, "use_double_wide_mlp": True, "vocab_size": 1000,
          "sliding_window": 8, "final_logit_softcapping": 30.0,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
GEMMA4_CASE = "gemma4-kv-shared-k-eq-v-per-layer-inputs"
WINDOWED.append(GEMMA4_CASE)  # prompts several windows long, as for CASES with windows


def transformers_gemma4(folder, **changes):
    """A Gemma4ForCausalLM written by transformers (float32), its weights then spread."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**{**GEMMA4, **changes},
                                           architectures=["Gemma4ForCausalLM"])
    transformers.Gemma4ForCausalLM(config).float().save_pretrained(folder)
    return spread_gemma4(folder)


def spread_gemma4(folder):
    """`spread` for Gemma 4, whose norms, layer scalars and router scales hold the scale
    itself."""
    gen = torch.Generator().manual_seed(0)

    def change(tensors):
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen)
            if t.dim() == 1:  # norms, layer scalars, the router's scales
                tensors[name] = 1.0 + 0.3 * noise
            elif "embed" in name:
                tensors[name] = noise
            else:
                gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                tensors[name] = gain * noise / t.shape[-1] ** 0.5
    edit_tensors(folder, change)
    return folder


# Gemma 4's mixture of experts (gemma-4-26B-A4B's kind): 8 experts, 2 per token, beside every
# layer's dense MLP, the router's scales spread away from 1
GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
              "moe_intermediate_size": 48}


# Full layers with twice the sliding layers' bytes per token (2 KV heads of 128 beside 2 of 64),
# K = V or with their own V: vLLM gives the sliding layers blocks of twice the tokens (the
# harness's block 4: 8 and 4), and a full layer's token fills 2 rows of the cache
GEMMA4_WIDE = {"num_global_key_value_heads": 2}
GEMMA4_WIDE_V = {"attention_k_eq_v": False}


@pytest.mark.parametrize("strategy,changes", [
    pytest.param("eager", {}, id="dense-eager"), pytest.param("eager_summed", {}, id="dense-summed"),
    pytest.param("eager", GEMMA4_MOE, id="experts-eager"),
    pytest.param("eager", GEMMA4_WIDE, id="wide-eager"),
    pytest.param("eager_summed", GEMMA4_WIDE, id="wide-summed"),
    pytest.param("eager", GEMMA4_WIDE_V, id="wide-own-v-eager"),
    # compiled once, on the wide model: it runs every compiled part of Gemma 4's step (KV-shared
    # layers, per-layer inputs, K = V) and the per-group blocks besides; compiled steps of one
    # block size are the other guard_free cases' (~45 s each, so one here)
    pytest.param("guard_free", GEMMA4_WIDE, id="wide-guard-free", marks=pytest.mark.slow)])
def test_gemma4_prefill_and_paged_decode_match_transformers(tmp_path, strategy, changes):
    """On a checkpoint transformers wrote: prefill of 3 prompts of 33 tokens, then every paged
    decode step (prompts of 5, 30 and 37, 6 steps), float32 within 1e-4 of the largest logit;
    the KV-shared layers read their source layer's paged cache; dense, with experts, and with
    full layers wider per token than the sliding ones (their blocks half as long)."""
    folder = transformers_gemma4(tmp_path / "g4", **changes)
    model = kit_model(folder)
    assert sum(layer.moe is not None for layer in model.layers) == (6 if changes is GEMMA4_MOE
                                                                    else 0)
    full = (512, 256, 256) if changes is GEMMA4_WIDE_V else (512, 256) if changes is GEMMA4_WIDE \
        else (512, 128)
    assert [layer.self_attn.split for layer in model.layers] == [(256, 128, 128)] * 2 + [
        full] + [(256, 128, 128)] + [(256,), (512,)]
    wide = KVCacheLayout.for_model(model.arch, 4, "float32").decode_block_sizes
    assert wide == ((8, 8, 8, 4) if full != (512, 128) else None)
    got, expected = kit_and_reference_logits(folder, prompt_ids(GEMMA4_CASE))
    error = relative_error(got, expected)
    print(f"{GEMMA4_CASE}: prefill max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"]
    assert decode_error(folder, GEMMA4_CASE, strategy) <= kit.config.TOLERANCE["float32"]


def test_gemma4_checkpoints_the_kit_writes_are_transformers(tmp_path):
    """`kit checkpoint` on a Gemma 4 config (per-layer embeddings, layer scalars, no K or V on
    the shared layers, no V on K = V layers): transformers loads every tensor and agrees."""
    written = transformers_gemma4(tmp_path / "g4")
    folder = write_random_checkpoint(str(written / "config.json"), tmp_path / "kit", 3)
    spread_gemma4(folder)
    assert set(load_file(folder / "model.safetensors")) == set(
        load_file(written / "model.safetensors"))
    got, expected = kit_and_reference_logits(folder, prompt_ids(GEMMA4_CASE))
    assert relative_error(got, expected) <= kit.config.TOLERANCE["float32"]
