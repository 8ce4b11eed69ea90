"""`python -m kit explain` and chapter 06 on real vLLM start-up logs: ones vLLM's CPU engine
wrote on this kind of machine for a model of each kind (tests/fixtures/vllm_logs/cpu-*.log,
`make_cpu_logs.py`), and ones quoted in public issues and threads for GPUs (each with its
source in the .json beside it). For each: which numbers the kit reproduces, and for those it
does not, that it says why. Bad input: one clear message."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.errors import ConfigError
from kit.vllm.startup_log import read_log, read_log_file

# In the worker that sizes with vLLM elsewhere (test_vllm): vLLM imported and models inspected once.
pytestmark = pytest.mark.xdist_group("vllm_published")
LOGS = Path(__file__).parent / "fixtures" / "vllm_logs"
ROOT = Path(__file__).resolve().parent.parent

# The CPU engine's logs: every number agrees (the model by the name the log was written from).
CPU_AGREE = {
    "tiny": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib"},
    "tiny-gemma4": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib"},
    "tiny-moe": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib"},
    "tiny-mla": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib"},
    "tiny-mamba": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib", "attention_block_size",
                   "mamba_padding_pct"},
    "tiny-gdn": {"kv_cache_tokens", "max_concurrency", "cpu_kv_gib", "attention_block_size",
                 "mamba_padding_pct"},
}
# GPU logs from public threads: (numbers that agree, numbers that differ, with the word the
# reason must hold). Each one's model and the settings its thread states are in its .json.
PUBLIC = {
    "llama31-8b-rtx3090-20k": ({"gpu_blocks", "max_concurrency", "available_kv_gib",
                                "weights_gib"}, {}),
    "llama31-8b-rtx3090-29k": ({"gpu_blocks", "weights_gib", "too_long_tokens"}, {}),
    "qwen3-14b-lmcache-v1": ({"kv_cache_tokens", "max_concurrency", "available_kv_gib"}, {}),
    "qwen3-30b-a3b-a10x4-v085": ({"kv_cache_tokens", "max_concurrency", "weights_gib"}, {}),
    "qwen36-35b-a3b-nvfp4-rtx5090": ({"kv_cache_tokens", "max_concurrency",
                                      "available_kv_gib"}, {}),
    "deepseek-v3-0324-awq-tp16-v0": ({"available_kv_gib", "requested_gib",
                                      "kv_budget_arithmetic"}, {}),
    "gpt-oss-20b-a100-v0190": ({"available_kv_gib"}, {"weights_gib": "quantized"}),
    "qwen35-27b-h20-dummy": ({"kv_cache_tokens", "max_concurrency"}, {}),
    "gpt-oss-120b-h100-negative-kv": (set(), {"weights_gib": "quantized"}),
    "qwen36-35b-a3b-fp8-dflash-a800": ({"available_kv_gib"}, {"padding_layers": "drafter"}),
    "deepseek-v3-mi308x": (set(), {"kv_cache_tokens": "no KV cache memory"}),
}


def public_case(name: str, folder: Path):
    """The log, its model (a name under data/models/, or its published config.json written
    into `folder`) and the settings its thread states, as `explain` takes them."""
    meta = json.loads((LOGS / f"{name}.json").read_text())
    model = meta.get("config_name")
    if model is None:
        model = folder / name / "config.json"
        model.parent.mkdir(parents=True)
        model.write_text(json.dumps(meta["config"]))
    from kit.cli.explain import SET_NAMES
    given = {k: v for k, v in meta.get("settings", {}).items() if k in SET_NAMES}
    if meta.get("vllm_version"):
        given["vllm_version"] = meta["vllm_version"]
    return read_log_file(LOGS / f"{name}.log"), str(model), given


def verdicts(ex) -> tuple[set, dict]:
    agree = {n.key for n in ex.numbers if n.agrees}
    differ = {n.key: n.why or "" for n in ex.numbers if n.agrees is False}
    return agree, differ


def test_prefixes_order_and_rounding():
    """Lines as users paste them: vLLM's console prefix, the kit's capture, none; any order;
    numbers with thousands' commas; a logged GiB is the range its rounding allows."""
    log = read_log("\n".join([
        "(EngineCore_DP0 pid=77) INFO 10-03 16:22:17 [kv_cache_utils.py:2327] GPU KV cache "
        "size: 290,864 tokens, Maximum concurrency for 32,768 tokens per request: 33.04x",
        "unrelated line",
        "16:22:15.100 INFO [vllm.v1.worker.gpu_worker] Available KV cache memory: 6.51 GiB",
        "Model loading took 14.9888 GiB memory and 5.1 seconds"]))
    assert log.value("kv_cache_tokens") == 290864
    assert log.numbers["max_concurrency"][0].value == 32768
    assert log.numbers["max_concurrency"][1].text == "33.04"
    assert log.numbers["available_kv_gib"][0].bounds() == pytest.approx((6.505, 6.515))
    assert log.value("weights_gib") == 14.9888 and log.device == "GPU"


@pytest.mark.parametrize("text, says", [
    ("hello\nworld", "is not a vLLM start-up log"),
    ("INFO [core.py:1] Initializing a V1 LLM engine (v0.10.1) with config: model='m', "
     "max_seq_len=4096\nModel loading took 1.0 GiB and 2 s", "ends before vLLM sized"),
    ("vLLM API server version 0.5.4\nGPU KV cache size: 10 tokens", "vLLM 0.5.4.*0.6 to 0.32"),
])
def test_bad_logs_one_message(text, says):
    with pytest.raises(ConfigError, match=says):
        read_log(text)


def test_missing_file_and_bad_settings_before_vllm(tmp_path):
    """Nothing heavy starts for input that is wrong: the command says what to give, in one
    line, exit 2."""
    from kit.cli.explain import given_settings
    from kit.studies.your_vllm import target_of
    with pytest.raises(ConfigError, match="no log at"):
        read_log_file(tmp_path / "none.log")
    with pytest.raises(ConfigError, match="name=value"):
        given_settings(["block_sise=16"])
    with pytest.raises(ConfigError, match="REQUESTSxTOKENS"):
        target_of("many")
    (tmp_path / "x.log").write_text("not a log\n")
    done = subprocess.run([sys.executable, "-m", "kit", "explain", str(tmp_path / "x.log")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "not a vLLM start-up log" in done.stderr


@pytest.mark.vllm
def test_model_not_found_offline_and_contradicting(monkeypatch):
    from kit.vllm.log_numbers import explain
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    log = read_log_file(LOGS / "cpu-tiny.log")
    with pytest.raises(ConfigError, match="'nobody/no-such-model'.*--model"):
        explain(log, "nobody/no-such-model")
    with pytest.raises(ConfigError, match="served a LlamaForCausalLM.*Qwen3ForCausalLM"):
        explain(log, "qwen3-0.6b")


@pytest.mark.vllm
@pytest.mark.parametrize("model", sorted(CPU_AGREE))
def test_cpu_engine_logs_reproduced(model):
    """vLLM's CPU engine on this machine, a model of each kind: dense, windowed (Gemma 4),
    MoE, latent (MLA), Mamba-2 and gated delta-net hybrids. Every number agrees."""
    from kit.vllm.log_numbers import explain
    ex = explain(read_log_file(LOGS / f"cpu-{model}.log"), model)
    agree, differ = verdicts(ex)
    assert differ == {} and agree == CPU_AGREE[model]


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_logs_reproduced_or_explained(name, tmp_path):
    """GPU logs users posted: which numbers agree, and for each that does not, why."""
    from kit.vllm.log_numbers import explain
    ex = explain(*public_case(name, tmp_path))
    agree, differ = verdicts(ex)
    want_agree, want_differ = PUBLIC[name]
    assert agree == want_agree
    assert set(differ) == set(want_differ)
    for key, word in want_differ.items():
        assert word in differ[key], (key, differ[key])


@pytest.mark.vllm
def test_pitfalls_and_what_if(tmp_path):
    """The 29k-token Llama names the longest max_model_len that fits by 0.32's check (its
    1,478 blocks less the null block), beside the 0.6 engine's count; the hybrid names tokens against concurrency; fp8 doubles the blocks."""
    from kit.studies import your_vllm as advice
    from kit.vllm.log_numbers import explain
    ex = explain(*public_case("llama31-8b-rtx3090-29k", tmp_path))
    [too_long] = [p for p in advice.pitfalls(ex) if "does not fit" in p]
    assert "longest that does is 23,632 tokens" in too_long and "counted 23,648" in too_long
    hybrid = explain(*public_case("qwen36-35b-a3b-nvfp4-rtx5090", tmp_path))
    assert any(p.startswith("Tokens are not concurrency") for p in advice.pitfalls(hybrid))
    rows = {r.change: r for r in advice.what_if(explain(*public_case(
        "qwen3-14b-lmcache-v1", tmp_path)), (2, 32768))}
    assert rows["kv_cache_dtype=fp8"].max_concurrency == pytest.approx(
        2 * rows["as logged"].max_concurrency, rel=1e-3)
    assert rows["kv_cache_dtype=fp8"].reaches and not rows["as logged"].reaches


@pytest.mark.vllm
def test_json_document(tmp_path):
    """--json: for each number the log states, its logged value, the kit's and `agrees`."""
    done = subprocess.run([sys.executable, "-m", "kit", "explain", "--json", "--model", "tiny",
                           str(LOGS / "cpu-tiny.log")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert {n["key"]: (n["logged"], n["kit"], n["agrees"]) for n in doc["numbers"]} == {
        "kv_cache_tokens": ("32,768", "32,768", True),
        "max_concurrency": ("32.00", "32.00", True),
        "cpu_kv_gib": ("0.06", "0.06 GiB", True)}
    assert doc["settings"]["block_size"] == {"value": 32, "from": "the log"}


@pytest.mark.vllm
def test_a_refusal_leads_the_answer():
    """A log that ends in vLLM's refusal (KAITO#2319: a Qwen3.6-27B, its config the kit's
    Qwen3.5-27B shape) is answered with the cause and the fix; the memory the state blocks
    imply is said, not judged; max_model_len, which the log does not state, is the model's own."""
    from kit.studies import your_vllm
    ex = your_vllm.explain_log(LOGS / "qwen36-27b-h100-mamba-blocks-kaito.log", "qwen3.5-27b",
                               {"max_num_seqs": 1024})
    assert "Lower max_num_seqs to 614 or fewer" in your_vllm.answer(ex)
    [states] = ex.numbers
    assert states.agrees is None and "the KV cache memory the log implies" in states.how
    assert ex.run.source["max_model_len"].startswith("vLLM's default")
    assert ex.sizing.num_blocks == 614


@pytest.mark.vllm
def test_a_hybrids_prefix_caching_read_off_its_numbers(tmp_path):
    """vLLM #40691 (Qwen3.5-27B, vLLM 0.19): its log does not say whether prefix caching was
    on; only with it off (one Mamba state a request) do its tokens and concurrency both agree,
    at one block count of the four its tokens allow, and the kit says so."""
    from kit.vllm.log_numbers import explain
    ex = explain(*public_case("qwen35-27b-h20-dummy", tmp_path))
    assert ex.run.settings["enable_prefix_caching"] is False
    assert ex.run.source["enable_prefix_caching"].startswith("off: only so")
    assert ex.sizing.num_blocks == 1487 and f"{ex.sizing.max_concurrency:.2f}" == "33.04"


@pytest.mark.vllm
def test_the_cuda_graphs_estimate_and_every_padding_line(tmp_path):
    """vLLM #46462 (Qwen3.6-35B-A3B with a DFlash drafter, A800): both padding lines are read
    (6.67% and 60.00%), neither is the config's own (the drafter's layers are not in it), the
    CUDA-graph line implies the device's capacity (6.24 GiB ÷ (0.62 − 0.5413)), and turning the
    estimate off is a what-if row with the memory it frees."""
    from kit.studies import your_vllm
    log, model, given = public_case("qwen36-35b-a3b-fp8-dflash-a800", tmp_path)
    ex = your_vllm.explain(log, model, given)
    padding = ex.number("padding_layers")
    assert padding.logged == "2 layers, 6.67%; 6 layers, 60.00%" and padding.agrees is False
    equivalent = ex.number("equivalent_utilization")
    assert equivalent.agrees is None and "capacity of 79.29 GiB" in equivalent.how
    rows = {r.change: r for r in your_vllm.what_if(ex)}
    off = rows["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0"]
    assert off.max_concurrency > rows["as logged"].max_concurrency
    assert any("0.5413" in p for p in your_vllm.pitfalls(ex))


@pytest.mark.vllm
def test_a_compiled_model_not_loaded_back_is_a_pitfall():
    """A log whose engine compiled again because its compile cache did not load (vLLM 0.32's
    AOT cache with torch 2.13) says what every start then costs and what loads instead; the
    same log without that line names no such pitfall, and its numbers agree as before."""
    from kit.studies import your_vllm
    from kit.vllm.log_numbers import explain
    text = (LOGS / "cpu-tiny.log").read_text()
    failed = text + ("\n12:00:00.000 WARNING [vllm.compilation.decorators] [backbone] Compiling "
                     "model again due to a load failure from /cache/rank_0_0/model, reason: "
                     "'function' object has no attribute 'finalize_loading'\n")
    plain, again = (explain(read_log(t), "tiny") for t in (text, failed))
    [pitfall] = [p for p in your_vllm.pitfalls(again) if "compiled the model again" in p]
    assert "VLLM_USE_AOT_COMPILE=0" in pitfall
    assert not [p for p in your_vllm.pitfalls(plain) if "compiled the model again" in p]
    assert verdicts(again) == verdicts(plain)
