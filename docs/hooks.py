"""MkDocs hook (mkdocs.yml ``hooks:``): doctest examples in docstrings render as code.

qkv's docstrings hold plain doctest runs (``>>> x`` then the output), which the test suite
runs. In Markdown a ``>>>`` line is a nested block quote and ``[0.3, 0.6]`` a reference
link, so the API pages would show them mangled (and autorefs would report the lists as
missing cross-references). This hook adds a preprocessor to every Markdown run, the
mkdocstrings ones included, that fences each run of ``>>>``/``...`` lines and their output
(up to a blank line) as a ``pycon`` code block. Fenced blocks are left alone.
"""
from __future__ import annotations

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


class DoctestFenceExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's name)
        # before the fenced-code preprocessor (priority 25), so the fence it adds is read as one
        md.preprocessors.register(DoctestFence(md), "qkv_doctest_fence", 40)


def on_config(config, **kwargs):
    config.markdown_extensions.append(DoctestFenceExtension())
    return config
