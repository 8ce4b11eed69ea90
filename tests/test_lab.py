"""`kit lab`'s working copies: the first start copies the chapters, a restart keeps what a
participant saved (outputs included), a fresh start gives the originals back and sets the
copies aside. Plain Python, quick: no JupyterLab."""
import json
import platform

import pytest

from kit.cli.working_copies import ORIGINS, make_copies, where_your_work_is
from kit.errors import ConfigError
from kit.execute.notebooks import NOTEBOOKS_DIR
from kit.execute.stored_notebooks import clean

CHAPTERS = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))


def with_outputs(path):
    """`path` as a participant leaves it: a cell edited and run, its output saved."""
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["source"] = 'preset = "cpu-small"\nblock_size = 32\n'
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["mine\n"]}]
    cell["execution_count"] = 1
    path.write_text(json.dumps(nb))
    return path.read_bytes()


def test_the_first_start_copies_every_chapter(tmp_path):
    done = make_copies(tmp_path / "work")
    assert done.copied == CHAPTERS and not done.kept and done.set_aside is None
    for name in CHAPTERS:
        copy = json.loads((done.folder / name).read_text())
        original = json.loads((NOTEBOOKS_DIR / name).read_text())
        assert copy["cells"] == original["cells"]
        # the kernel's Python, as Lab would write it on opening (no unsaved mark)
        assert copy["metadata"]["language_info"]["version"] == platform.python_version()
        assert clean((done.folder / name).read_bytes()) == (NOTEBOOKS_DIR / name).read_bytes()
    assert "To start over" in where_your_work_is(done)[-1]


def test_a_restart_keeps_what_was_saved(tmp_path):
    work = tmp_path / "work"
    make_copies(work)
    saved = with_outputs(work / "02_kv_cache.ipynb")
    (work / "00_setup_check.ipynb").unlink()  # deleted: copied again
    (work / "mine.ipynb").write_text("{}")  # a participant's own notebook
    done = make_copies(work)
    assert done.copied == ["00_setup_check.ipynb"] and len(done.kept) == len(CHAPTERS) - 1
    assert (work / "02_kv_cache.ipynb").read_bytes() == saved
    assert (work / "mine.ipynb").read_text() == "{}" and not done.outdated
    assert "Copied now: 00_setup_check.ipynb; the others are as you left them." in \
        where_your_work_is(done)


def test_a_fresh_start_restores_the_originals_and_sets_the_copies_aside(tmp_path):
    work = tmp_path / "work"
    first = make_copies(work)
    saved = with_outputs(work / "02_kv_cache.ipynb")
    other = with_outputs(work / "04_decode_timing.ipynb")
    done = make_copies(work, ["02"])  # one chapter, by its number
    assert done.copied == ["02_kv_cache.ipynb"]
    assert (work / "02_kv_cache.ipynb").read_text() == \
        (first.folder / "02_kv_cache.ipynb").read_text() != saved.decode()
    assert (done.set_aside / "02_kv_cache.ipynb").read_bytes() == saved
    assert (work / "04_decode_timing.ipynb").read_bytes() == other
    assert f"Your earlier copies are in {done.set_aside}." in where_your_work_is(done)
    every = make_copies(work, [])  # all of them
    assert every.copied == CHAPTERS and every.set_aside != done.set_aside
    assert (every.set_aside / "04_decode_timing.ipynb").read_bytes() == other
    with pytest.raises(ConfigError, match="unknown notebook '99'"):
        make_copies(work, ["99"])


def test_a_copy_whose_original_changed_is_named(tmp_path):
    """When notebooks/ has a newer chapter than the copy (a `git pull` during a workshop), the
    copy is kept and `kit lab` says how to get the new one."""
    work = tmp_path / "work"
    make_copies(work)
    origins = json.loads((work / ORIGINS).read_text())
    origins["02_kv_cache.ipynb"] = "0" * 64  # as if copied from an earlier original
    (work / ORIGINS).write_text(json.dumps(origins))
    done = make_copies(work)
    assert done.outdated == ["02_kv_cache.ipynb"] and not done.copied
    assert any("`kit lab --fresh 02`" in line for line in where_your_work_is(done))
