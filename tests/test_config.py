import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kit.config import (DATA, DEFAULT_PRESET, MODELS_DIR, PARAMETERS, ModelConfig, known_names,
                        load, read_preset)
from kit.units import parse_bytes
from kit.errors import ConfigError
from kit.vllm.model_folder import cached_model_folder

# Published parameter counts of the real checkpoints these shapes come from.
PUBLISHED_PARAMETERS = {"gemma-2b": 2_506_172_416, "llama-3.2-1b": 1_235_814_400,
                        "qwen2.5-0.5b": 494_032_768, "llama-3.1-8b": 8_030_261_248,
                        "qwen3-0.6b": 596_049_920, "gemma-3-1b": 999_885_952,
                        "gemma-2-2b": 2_614_341_888, "mistral-7b-v0.1": 7_241_732_096,
                        "qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704}


@pytest.mark.parametrize("name,count", PUBLISHED_PARAMETERS.items())
def test_presets_match_published_parameter_counts(name, count):
    assert ModelConfig.load(name).num_parameters() == count


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.91, 3.61),
                                               ("gpt-oss-120b", 116.83, 5.13)])
def test_gpt_oss_matches_its_model_cards_counts(name, total, active):
    """OpenAI's model card gives billions to two decimals: every expert, and those one token
    runs (its 4 experts, attention, the routers and the LM head)."""
    arch = ModelConfig.load(name)
    assert round(arch.num_parameters() / 1e9, 2) == total
    assert round(arch.linear_weights(active=True) / 1e9, 2) == active


def test_presets_load_with_their_families():
    assert ModelConfig.load("gemma-2b").parts.norm == "gemma_rms" and ModelConfig.load("gemma-2b").num_key_value_heads == 1
    assert ModelConfig.load("qwen2.5-0.5b").attention_bias
    assert ModelConfig.load("qwen2.5-0.5b").head_dim == 64  # derived: 896 / 14
    assert ModelConfig.load("gemma-2b").hidden_act == "gelu_pytorch_tanh"


def write_config(tmp_path, **changes):
    hf = {**ModelConfig.load("tiny").hf_dict(), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    return path


def test_config_json_path_with_head_dim_unlike_hidden_over_heads(tmp_path):
    path = write_config(tmp_path, head_dim=80, model_type="mistral")
    s = load(model=str(path))
    assert s.arch.head_dim == 80 and s.arch.family == "mistral"
    assert load(model=str(tmp_path)).arch.head_dim == 80  # a folder holding config.json


def test_config_json_as_transformers_5_writes_it(tmp_path):
    """transformers 5 writes `dtype` and `rope_parameters` instead of `torch_dtype` and
    `rope_theta`; both are read (else the kit would run rope_theta 10000 and bfloat16)."""
    hf = ModelConfig.load("qwen2.5-0.5b").hf_dict()
    del hf["torch_dtype"], hf["rope_theta"]
    hf.update(dtype="float32", rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    arch = ModelConfig.from_dict(hf, "t5")
    assert (arch.rope_theta, arch.torch_dtype) == (1e6, "float32")


def test_unsupported_family_is_refused(tmp_path):
    path = write_config(tmp_path, model_type="gpt2")
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load(model=str(path))


@pytest.mark.parametrize("family,need", [("kimi_k2", "multi-head latent attention"),
                                         ("dbrx", "mixture of experts"),
                                         ("falcon_h1", "linear-attention")])
def test_out_of_reach_kinds_are_refused_by_what_they_need(tmp_path, family, need):
    with pytest.raises(ConfigError, match=f"model_type '{family}' is not supported .*{need}"
                       r".*covers \['deepseek_v2', 'deepseek_v3', 'gemma'"):
        load(model=str(write_config(tmp_path, model_type=family)))


def test_layer_kinds_of_the_published_shapes():
    """Each family's own rule for which layers slide, as its config class derives it."""
    def sliding(name):
        arch = ModelConfig.load(name)
        return [i for i in range(arch.num_hidden_layers) if arch.window(i)]
    assert sliding("gemma-3-1b") == [i for i in range(26) if i % 6 != 5]  # five local, one global
    assert sliding("gemma-2-2b") == list(range(0, 26, 2))  # alternating, the first local
    assert sliding("mistral-7b-v0.1") == list(range(32))
    assert sliding("qwen3-0.6b") == sliding("qwen2.5-0.5b") == []  # use_sliding_window: false
    gemma3 = ModelConfig.load("gemma-3-1b")
    assert (gemma3.window(0), gemma3.window(5)) == (512, None)
    assert (gemma3.layer_rope_theta(0), gemma3.layer_rope_theta(5)) == (10000, 1000000)
    assert gemma3.attention_scale == 256 ** -0.5 and gemma3.parts.qk_norm


def test_config_keys_are_read_or_refused_by_name(tmp_path):
    """Nothing a config.json says is dropped silently."""
    with pytest.raises(ConfigError, match=r"does not build: \['num_experts'\]"):
        load(model=str(write_config(tmp_path, num_experts=8)))
    with pytest.raises(ConfigError, match=r"only at their defaults: \['mlp_bias=True'\]"):
        load(model=str(write_config(tmp_path, mlp_bias=True)))
    with pytest.raises(ConfigError, match="sliding layers need a positive whole sliding_window"):
        load(model=str(write_config(tmp_path, layer_types=["sliding_attention"] * 4)))
    with pytest.raises(ConfigError, match="layer_types must name"):
        load(model=str(write_config(tmp_path, layer_types=["full_attention"])))


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-2-2b", "mistral-7b-v0.1", "qwen3-0.6b",
                                  "qwen2.5-0.5b"])
def test_the_config_the_kit_writes_reads_back_the_same(name):
    arch = ModelConfig.load(name)
    assert ModelConfig.from_dict(arch.hf_dict(), arch.name) == arch


def test_gemma3_rope_as_transformers_5_writes_it():
    """transformers 5 writes one `rope_parameters` per attention kind for Gemma 3."""
    hf = ModelConfig.load("gemma-3-1b").hf_dict()
    del hf["rope_theta"], hf["rope_local_base_freq"]
    hf["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    arch = ModelConfig.from_dict(hf, "g3")
    assert (arch.layer_rope_theta(0), arch.layer_rope_theta(5)) == (1e4, 1e6)


@pytest.mark.parametrize("overrides,message", [
    ({"model": "nope"}, r"unknown model 'nope': give one of \['deepseek-v2-lite', 'deepseek-v3', "
     r"'gemma-2-2b'"),
    ({"gpu_memory_utilization": 0}, r"must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"must be in \(0, 1\]"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0 must be a positive whole number"),
    ({"max_num_seqs": -1}, "max_num_seqs=-1 must be a positive whole number"),
    ({"input_len": 2.5}, "input_len=2.5 must be a positive whole number"),
    ({"max_model_len": 4096}, "beyond tiny's max_position_embeddings=2048"),
    ({"batch_size": 64}, "batch_size=64 is above max_num_seqs=8"),
    ({"input_len": 1000, "output_len": 100}, "exceeds max_model_len=1024"),
    ({"dtype": "int4"}, "dtype='int4'"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"device_memory": "lots"}, "is not a size: write one such as 16GiB"),
    ({"colour": "red"}, r"unknown parameter\(s\) \['colour'\]"),
])
def test_bad_settings_get_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load("cpu-small", **overrides)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge': give one of \['cpu-real', 'cpu-small', 'gpu'\]"):
        load("huge")


def test_cuda_without_cuda_is_refused():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        load("cpu-small", device="cuda")
    with pytest.raises(ConfigError, match="no CUDA device"):
        load("gpu")


def test_the_default_preset_is_on_the_cpu_on_any_machine():
    """The default preset (the tests' and a plain `python -m kit run`'s) is calibrated for the
    CPU: its device is "cpu", not "auto", so on a GPU machine its 96 MiB emulated device does
    not move onto CUDA (the gpu preset is for a GPU)."""
    assert read_preset(DEFAULT_PRESET)["device"] == "cpu"
    assert load().device == "cpu"


def test_a_run_says_where_it_runs_and_points_a_gpu_machine_to_the_gpu_preset(tmp_path,
                                                                           monkeypatch):
    from kit.execute.notebooks import device_line
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert device_line("cpu-small", load()) == "preset cpu-small: tiny (bfloat16) on the CPU"
    smi = tmp_path / "nvidia-smi"  # what setup.sh and this line look for
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert device_line("cpu-small", load()).endswith("--preset gpu runs the chapters on it")


def test_sizes_parse():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes(1234) == 1234 and parse_bytes(None) is None


def test_overrides_and_none_keep_the_preset():
    s = load("cpu-small", max_num_batched_tokens=None, dtype="fp32")
    assert s.max_num_batched_tokens == 2048 and s.dtype == "float32" and s.dtype_bytes == 4
    assert s.device_memory == 96 * 2**20
    assert set(PARAMETERS) >= {"model", "device", "max_num_batched_tokens", "gpu_memory_utilization"}


def test_vllm_model_folders_have_a_stable_path_per_config(tmp_path):
    """vLLM keys its compile cache by the model's path: the same config, the same folder."""
    from kit.vllm.model_folder import MODELS_CACHE, cached_model_folder, write_model_folder
    tiny, other = load("cpu-small").arch, load("cpu-small", model="qwen2.5-0.5b").arch
    assert cached_model_folder(tiny) == cached_model_folder(load("cpu-small").arch)
    assert cached_model_folder(tiny) != cached_model_folder(other)
    assert cached_model_folder(tiny).parent == MODELS_CACHE
    assert cached_model_folder(tiny).name.startswith("tiny-")
    written = write_model_folder(tiny, tmp_path / "tiny")  # an explicit folder is kept
    assert written == tmp_path / "tiny" and (written / "config.json").is_file()


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text", "mistral", "qwen3", "llama",
                                    "qwen3_moe", "mixtral", "llama4_text"])
def test_keys_left_out_read_as_transformers_reads_them(family):
    """A config.json that leaves keys out means what its family's transformers config class
    assumes (vLLM reads it through that class too): caps, scalar, window, head_dim, RoPE,
    the experts."""
    from transformers import AutoConfig
    hf = {"model_type": family, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 101}
    kit_cfg = ModelConfig.from_dict(hf, "bare")
    ref = AutoConfig.for_model(**hf)
    assert kit_cfg.head_dim == (getattr(ref, "head_dim", None) or 64 // 4)
    assert kit_cfg.max_position_embeddings == ref.max_position_embeddings
    assert kit_cfg.hidden_act == (getattr(ref, "hidden_activation", None) or ref.hidden_act)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(kit_cfg, key) == getattr(ref, key, None), key
    kinds = getattr(ref, "layer_types", None) or ["full_attention"] * 6
    if family == "mistral":  # MistralConfig slides every layer when sliding_window is set
        kinds = ["sliding_attention" if ref.sliding_window else "full_attention"] * 6
    assert [kit_cfg.window(i) for i in range(6)] == \
        [ref.sliding_window if k == "sliding_attention" else None for k in kinds]
    if family == "gemma3_text":
        params = ref.rope_parameters
        assert (kit_cfg.layer_rope_theta(0), kit_cfg.layer_rope_theta(5)) == (
            params["sliding_attention"]["rope_theta"], params["full_attention"]["rope_theta"])
    assert kit_cfg.rms_norm_eps == ref.rms_norm_eps
    if family in ("qwen3_moe", "mixtral"):
        assert (kit_cfg.num_experts, kit_cfg.num_experts_per_tok) == (
            ref.num_local_experts, ref.num_experts_per_tok)
        assert kit_cfg.moe_intermediate_size == getattr(ref, "moe_intermediate_size",
                                                        ref.intermediate_size)
        assert kit_cfg.norm_topk_prob == getattr(ref, "norm_topk_prob", True)
        assert kit_cfg.mlp_kinds == ("experts",) * 6


def test_experts_keys_are_refused_where_nothing_routes_and_checked_where_it_does(tmp_path):
    """A dense family given expert keys is refused by name (they would be ignored), and an
    MoE config whose experts cannot be built says which values are wrong."""
    with pytest.raises(ConfigError, match=r"does not build: \['num_experts_per_tok', "
                                          r"'num_local_experts'\]"):
        load(model=str(write_config(tmp_path, num_local_experts=8, num_experts_per_tok=2)))
    for bad in ({"num_local_experts": 2, "num_experts_per_tok": 3},
                {"num_local_experts": 0, "num_experts_per_tok": 1}):
        with pytest.raises(ConfigError, match="a mixture of experts needs"):
            load(model=str(write_config(tmp_path, model_type="mixtral", **bad)))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        load(model=str(write_config(tmp_path, model_type="qwen3_moe", mlp_only_layers=[99])))


# A model by its Hugging Face id: the Hub is offline and its cache a temporary folder, in this
# process (huggingface_hub reads its environment once, when first imported: its constants are
# set too) and in the processes a test starts. No test here reaches the network.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    cache = tmp_path / "hf" / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_config(cache, repo_id: str, hf: dict | None) -> None:
    """`repo_id` at COMMIT in the cache's layout, as hf_hub_download leaves it: the file under
    snapshots/<commit>/, refs/main naming the commit; hf None: the cache remembers that the
    repository has no config.json (.no_exist/<commit>/config.json)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    where = repo / ("snapshots" if hf is not None else ".no_exist") / COMMIT / "config.json"
    where.parent.mkdir(parents=True)
    where.write_text(json.dumps(hf) if hf is not None else "")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def test_a_hub_id_reads_its_config_json_from_the_cache(hub_cache):
    from huggingface_hub import hf_hub_download
    published = json.loads((DATA / "models" / "qwen3-0.6b.json").read_text())
    cache_config(hub_cache, "Qwen/Qwen3-0.6B", published)
    # the layout is the one huggingface_hub itself reads, offline
    assert hf_hub_download("Qwen/Qwen3-0.6B", "config.json") == \
        str(hub_cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / COMMIT / "config.json")
    s = load("cpu-small", model="Qwen/Qwen3-0.6B")
    assert s.model == s.arch.name == "Qwen/Qwen3-0.6B"
    assert s.arch == replace(ModelConfig.load("qwen3-0.6b"), name="Qwen/Qwen3-0.6B")
    assert s.arch.checkpoint is None  # the kit never downloads weights: random ones
    # vLLM's model folder (chapter 05) and its logs name the id as one folder name
    assert cached_model_folder(s.arch).name.startswith("Qwen--Qwen3-0.6B-")


def test_a_hub_id_not_in_the_cache_with_the_hub_offline_is_one_clear_message(hub_cache):
    with pytest.raises(ConfigError) as e:
        ModelConfig.load("nope/nothing")
    assert str(e.value) == (
        f"model 'nope/nothing': the Hub is offline (HF_HUB_OFFLINE=1) and its config.json is "
        f"not in the Hugging Face cache {hub_cache} (fetch it once with the network on); instead "
        f"give one of {known_names(MODELS_DIR)} (data/models/), or the path of a Hugging Face "
        "style config.json or of a model folder")


def test_a_hub_id_whose_repository_has_no_config_json_says_so(hub_cache):
    cache_config(hub_cache, "someone/weights-only", None)
    with pytest.raises(ConfigError, match="'someone/weights-only': its repository on the Hub "
                       r"holds no config.json \(as the cache remembers\); instead give one of"):
        ModelConfig.load("someone/weights-only")


def test_a_local_path_wins_over_a_hub_id_of_the_same_spelling(hub_cache, tmp_path, monkeypatch):
    cache_config(hub_cache, "org/name", ModelConfig.load("qwen3-0.6b").hf_dict())
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    write_config(folder)  # tiny's shape
    monkeypatch.chdir(tmp_path)
    arch = ModelConfig.load("org/name")
    assert (arch.name, arch.hidden_size) == ("name", ModelConfig.load("tiny").hidden_size)
    with pytest.raises(ConfigError, match="unknown model 'org/name.json'"):
        ModelConfig.load("org/name.json")  # a name ending in .json is a path, never an id


def test_kit_run_refuses_an_unknown_hub_id_before_any_notebook(hub_cache, tmp_path):
    """One line on stderr, exit status 2, no traceback, no run folder (no kernel started)."""
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "kit", "run", "02", "-p", "model=nope/nothing",
                           "--no-progress", "--out", str(out)], cwd=DATA.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and not out.exists()
    assert done.stderr.startswith("error: model 'nope/nothing': the Hub is offline") \
        and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
