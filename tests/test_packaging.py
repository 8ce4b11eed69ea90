"""The set-up files agree with each other and with the README."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!\[ ]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = names(project["dependencies"]) | names(project["optional-dependencies"]["test"])
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
