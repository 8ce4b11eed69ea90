"""The chapters' LaTeX math on the offline pages: MathML the browser draws, no MathJax."""
import shutil

import nbformat

from kit.execute.notebooks import NOTEBOOKS_DIR
from kit.pages.math import render_math, to_mathml
from kit.pages.notebook_page import notebook_page


def test_the_chapters_constructs_become_mathml():
    floor = to_mathml(r"\text{floor} = \frac{\text{weights} + \text{logits}}{\text{bandwidth}}",
                      block=True)
    assert floor == ('<math display="block"><mrow><mtext>floor</mtext><mo>=</mo><mfrac><mrow>'
                     '<mtext>weights</mtext><mo>+</mo><mtext>logits</mtext></mrow><mrow>'
                     '<mtext>bandwidth</mtext></mrow></mfrac></mrow></math>')
    floor_of = to_mathml(r"\left\lfloor \frac{a}{b} \right\rfloor", block=False)
    assert "<mo>⌊</mo><mfrac>" in floor_of and floor_of.endswith("<mo>⌋</mo></mrow></mrow></math>")
    power = to_mathml(r"\left(1 - \tfrac{k}{E}\right)^{B}", block=False)
    assert power.startswith("<math><mrow><msup><mrow><mo>(</mo><mn>1</mn><mo>−</mo><mfrac>")
    assert "&#95;" in to_mathml(r"\texttt{max\_model\_len}", block=False)  # no markdown emphasis


def test_what_is_not_math_stays_as_written():
    assert render_math("the compiler (`$CXX`, else `g++`) and `$CC`") == \
        "the compiler (`$CXX`, else `g++`) and `$CC`"
    assert render_math(r"$\unknowncommand{x}$") == r"$\unknowncommand{x}$"
    assert render_math("costs $(1 - k/E)^B$ each").startswith("costs <math><mrow><mo>(</mo>")


def test_every_chapter_page_draws_its_math(tmp_path):
    for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        shutil.copy(path, tmp_path / path.name)
        page = notebook_page(tmp_path / path.name).read_text()
        markdown = "".join(c.source for c in nbformat.read(path, as_version=4).cells
                           if c.cell_type == "markdown")
        assert "$$" not in page and r"\frac" not in page and r"\text{" not in page, path.name
        assert page.count("<math") == markdown.count("$$") // 2 + (path.stem == "04_decode_timing")
