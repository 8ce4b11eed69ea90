"""Executed notebooks as HTML pages beside them in the run folder, offline: plotly outputs drawn
with the run folder's plotly.js, LaTeX math as MathML (`kit.pages.math`), widgets (not live in
a static page) replaced by a note.
"""
from __future__ import annotations

from pathlib import Path

from kit.pages.html import plotly_js
from kit.pages.math import render_math

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_FILE = "plotly.min.js"  # beside the notebook pages, which share it

# nbconvert's lab template, minus everything it would fetch from a CDN (require.js, MathJax,
# mermaid, the widget manager); plotly.js comes from the run folder instead.
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}<script src="PLOTLY_FILE"></script>{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
""".replace("PLOTLY_FILE", PLOTLY_FILE)


def notebook_page(ipynb: Path) -> Path:
    """Render an executed notebook as HTML beside it, offline: plotly outputs drawn with the
    run folder's plotly.js, widgets (not live in a static page) replaced by a note."""
    import jinja2
    import nbformat
    import plotly.io as pio
    from nbconvert import HTMLExporter
    nb = nbformat.read(ipynb, as_version=4)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "markdown":  # no MathJax offline: the math as MathML
            cell.source = render_math(cell.source)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY_MIME in data:
                data["text/html"] = pio.to_html(dict(data.pop(PLOTLY_MIME)), full_html=False,
                                                include_plotlyjs=False, validate=False)
            if WIDGET_MIME in data:
                data.clear()
                data["text/html"] = ("<p><i>An interactive widget: open the notebook in "
                                     "JupyterLab to use it.</i></p>")
    exporter = HTMLExporter(template_name="lab", template_file="kit_offline.html.j2",
                            extra_loaders=[jinja2.DictLoader(
                                {"kit_offline.html.j2": OFFLINE_TEMPLATE})])
    body, _ = exporter.from_notebook_node(nb)
    out = ipynb.with_suffix(".html")
    out.write_text(body, encoding="utf-8")
    return out


def notebook_pages(folder: Path, notebooks: list[dict]) -> dict[str, str]:
    """Render every executed notebook; returns notebook -> relative link (failures noted)."""
    links = {}
    for nb in notebooks:
        ipynb = folder / f"{nb['notebook']}.ipynb"
        if not ipynb.is_file():
            continue
        try:
            links[nb["notebook"]] = notebook_page(ipynb).name
        except Exception as e:  # a page we cannot render must not cost the report
            print(f"report: could not render {ipynb.name} as HTML ({type(e).__name__}: {e})")
    if links:
        (folder / PLOTLY_FILE).write_text(plotly_js(), encoding="utf-8")
    return links
