"""The README and the pages under docs/ hold together: every relative link reaches a file, and
a heading of it where the link names one; the README stays short; the index lists every page."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def prose(text):
    """The lines outside fenced code blocks, and with inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation but hyphens (and underscores)
    removed, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading reads as its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path):
    for line in prose(path.read_text()):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                yield target


def broken_links(pages, root=ROOT):
    broken = []
    for page in pages:
        for target in relative_links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_reaches_a_file_and_heading():
    assert DOCS.is_dir() and len(PAGES) > 2
    assert broken_links(PAGES) == []


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## A section, with `code`\n\n"
                                   "[ok](#a-section-with-code) [file](b.md) [anchor](#nowhere)\n"
                                   "```\n[in a code block](missing.md)\n```\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: b.md (no such file)",
                                         "a.md: #nowhere (no such heading)"]


def test_slugs_follow_githubs_rule():
    assert slug("Experts against vLLM's fused MoE") == "experts-against-vllms-fused-moe"
    assert (slug("The first run on a new GPU: `python -m kit validate`")
            == "the-first-run-on-a-new-gpu-python--m-kit-validate")
    assert slug("`kit bench vllm`") == "kit-bench-vllm"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the depth to docs/"


def test_the_docs_index_links_every_page():
    index = DOCS / "README.md"
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in relative_links(index)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p != index and p.resolve() not in linked]
    assert missing == [], f"docs/README.md does not link {missing}"
