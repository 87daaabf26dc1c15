"""MkDocs hook (mkdocs.yml ``hooks:``): doctest examples in docstrings render as code.

qkv's docstrings hold plain doctest runs (``>>> x`` then the output), which the test suite
runs. In Markdown a ``>>>`` line is a nested block quote and ``[0.3, 0.6]`` a reference
link, so the API pages would show them mangled (and autorefs would report the lists as
missing cross-references). This hook adds a preprocessor to every Markdown run, the
mkdocstrings ones included, that fences each run of ``>>>``/``...`` lines and their output
(up to a blank line) as a ``pycon`` code block. Fenced blocks are left alone.

The docstrings' cross-references are Sphinx roles (``:func:`qkv.attention```, ``:mod:`~qkv.kernels.reference```,
``:class:`.Tiles```), one convention for the whole tree. A second preprocessor renders them: a
role naming a whole ``qkv.`` path becomes an autorefs cross-reference (a link where the API
reference renders that object, its name as code where it does not: ``optional``, so the strict
build stays quiet about the modules the reference leaves out); a relative or bare one becomes
its name as code. ``~`` shows the last part of the path only, as Sphinx does. No role reaches a
page as raw text.

A third renders reStructuredText's literal-block marker: a paragraph that ends in ``::`` before
an indented block ends in ``:`` on the page (a ``::`` alone on its line goes), and the indented
block is fenced as code, as Sphinx shows it.
"""
from __future__ import annotations

import html
import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

PROMPT = re.compile(r"^(?P<indent>\s*)>>>( |$)")
FENCE = re.compile(r"^\s*(```|~~~)")


class DoctestFence(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out, fenced, i = [], False, 0
        while i < len(lines):
            line = lines[i]
            if FENCE.match(line):
                fenced = not fenced
            m = None if fenced else PROMPT.match(line)
            if not m:
                out.append(line)
                i += 1
                continue
            indent = m.group("indent")
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(lines[i][len(indent):])
                i += 1
            out += ["", indent + "```pycon", *(indent + b for b in block), indent + "```", ""]
        return out


ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj):`(~?)([^`]+)`")


def render_role(match: re.Match) -> str:
    """One role as an autorefs cross-reference (a whole qkv path) or as code (anything else)."""
    tilde, target = match.groups()
    target = target.strip()
    shown = target.rsplit(".", 1)[-1] if tilde else target.lstrip(".")
    code = f"<code>{html.escape(shown)}</code>"
    if target.startswith("qkv.") and re.fullmatch(r"[A-Za-z0-9_.]+", target):
        return f'<autoref identifier="{target}" optional>{code}</autoref>'
    return code


class SphinxRoles(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out, fenced = [], False
        for line in lines:
            if FENCE.match(line):
                fenced = not fenced
            out.append(line if fenced else ROLE.sub(render_role, line))
        return out


class LiteralBlocks(Preprocessor):
    """``text::`` + a blank line + an indented block -> ``text:`` + a fenced code block."""

    def run(self, lines: list[str]) -> list[str]:
        out, fenced, i = [], False, 0
        while i < len(lines):
            line = lines[i]
            if FENCE.match(line):
                fenced = not fenced
            if fenced or not line.rstrip().endswith("::") or line.strip().startswith(":::"):
                out.append(line)
                i += 1
                continue
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_indent = len(lines[j]) - len(lines[j].lstrip()) if j < len(lines) else 0
            if j == len(lines) or block_indent <= indent:
                out.append(line)   # no indented block follows: not a literal-block marker
                i += 1
                continue
            text = line.rstrip()[:-2].rstrip()
            if text.strip():
                out.append(text + ":")
            block = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) >= block_indent):
                block.append(lines[j][block_indent:] if lines[j].strip() else "")
                j += 1
            while block and not block[-1]:
                block.pop()
            pad = " " * indent
            out += ["", pad + "```text", *(pad + b if b else "" for b in block), pad + "```", ""]
            i = j
        return out


class DoctestFenceExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's name)
        # before the fenced-code preprocessor (priority 25), so the fence it adds is read as one
        md.preprocessors.register(DoctestFence(md), "qkv_doctest_fence", 40)
        md.preprocessors.register(SphinxRoles(md), "qkv_sphinx_roles", 39)
        md.preprocessors.register(LiteralBlocks(md), "qkv_literal_blocks", 41)


def on_config(config, **kwargs):
    config.markdown_extensions.append(DoctestFenceExtension())
    return config
