"""The chapters' LaTeX math as MathML, which a browser draws without a script or a network
(the offline pages carry no MathJax): the few constructs the chapters write (text, fractions,
floors and ceilings, powers, spaces, a few symbols). Anything else stays as it was written."""
from __future__ import annotations

import html
import re

TOKEN = re.compile(r"\\[A-Za-z]+|\\.|[{}^_]|\s+|[A-Za-z]|[0-9]+(?:\.[0-9]+)?|.")
SYMBOLS = {r"\times": "×", r"\cdot": "·", r"\lfloor": "⌊", r"\rfloor": "⌋", r"\lceil": "⌈",
           r"\rceil": "⌉", r"\_": "_", r"\{": "{", r"\}": "}", r"\,": "\u2009", r"\;": " "}
NAMES = {r"\max": "max", r"\min": "min", r"\log": "log"}
SPACES = {r"\quad": "1em", r"\qquad": "2em"}
TEXT = {r"\text": "", r"\mathrm": "", r"\texttt": ' style="font-family:monospace"'}
FRACTIONS = (r"\frac", r"\tfrac", r"\dfrac")
CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)  # left alone: `$CXX` is no math
MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)


class Unknown(ValueError):
    """A construct this converter does not know: the math stays as written."""


def text_node(text: str) -> str:
    """Escaped for HTML, and kept from markdown's emphasis (the page's markdown reads it)."""
    return html.escape(text).replace("_", "&#95;").replace("*", "&#42;")


class Parser:
    def __init__(self, tex: str):
        self.tokens, self.i = TOKEN.findall(tex), 0

    def next(self) -> str:
        if self.i >= len(self.tokens):
            raise Unknown("unexpected end")
        self.i += 1
        return self.tokens[self.i - 1]

    def row(self, stop: str | None = None) -> str:
        """Items up to `stop` (consumed) or the end, a power or index bound to the one before."""
        out = []
        while self.i < len(self.tokens) and self.tokens[self.i] not in (stop, r"\right"):
            if self.tokens[self.i] in ("^", "_") and out:
                tag = "msup" if self.next() == "^" else "msub"
                out[-1] = f"<{tag}>{out[-1]}{self.atom()}</{tag}>"
            else:
                out.append(self.atom())
            out = [o for o in out if o]
        if stop and self.i < len(self.tokens) and self.tokens[self.i] == stop:
            self.i += 1
        return "".join(out)

    def raw_group(self) -> str:
        """The text of a {...} group as written (for \\text), its escapes undone."""
        if self.next() != "{":
            raise Unknown("a text without braces")
        depth, words = 1, []
        while True:
            t = self.next()
            depth += {"{": 1, "}": -1}.get(t, 0)
            if depth == 0:
                return "".join(words)
            words.append(SYMBOLS.get(t, t))

    def atom(self) -> str:
        t = self.next()
        if t == "{":
            return f"<mrow>{self.row('}')}</mrow>"
        if t in TEXT:
            return f"<mtext{TEXT[t]}>{text_node(self.raw_group())}</mtext>"
        if t in FRACTIONS:
            return f"<mfrac>{self.atom()}{self.atom()}</mfrac>"
        if t == r"\left":
            opening = self.delimiter()
            inner = self.row()
            self.next()  # \right
            return f"<mrow>{opening}{inner}{self.delimiter()}</mrow>"
        if t in SPACES:
            return f'<mspace width="{SPACES[t]}"/>'
        if t in SYMBOLS or t in NAMES:
            tag = "mi" if t in NAMES else "mo"
            return f"<{tag}>{text_node(SYMBOLS.get(t) or NAMES[t])}</{tag}>"
        if t.startswith("\\"):
            raise Unknown(t)
        if t.isspace():
            return ""
        tag = "mi" if t.isalpha() else "mn" if t[0].isdigit() else "mo"
        return f"<{tag}>{text_node('−' if t == '-' else t)}</{tag}>"

    def delimiter(self) -> str:
        t = self.next()
        return f"<mo>{text_node(SYMBOLS.get(t, '' if t == '.' else t))}</mo>"


def to_mathml(tex: str, block: bool) -> str:
    """`tex` as one <math> element (on one line, so it stays in its paragraph)."""
    display = ' display="block"' if block else ""
    return f"<math{display}><mrow>{Parser(tex.strip()).row()}</mrow></math>"


def render_math(markdown: str) -> str:
    """Every $$...$$ and $...$ of a markdown text, outside its code, as MathML; one it cannot
    read stays as written."""
    def replace(m):
        try:
            return to_mathml(m.group(1) or m.group(2), block=m.group(1) is not None)
        except Unknown:
            return m.group(0)
    parts = CODE.split(markdown)
    return "".join(p if i % 2 else MATH.sub(replace, p) for i, p in enumerate(parts))
