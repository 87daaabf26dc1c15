"""The API pages read as the guide does (issue 61): reStructuredText's ``::`` literal-block marker
becomes a colon and a code block (docs/hooks.py), and no page shows its module's heading twice."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
markdown = pytest.importorskip("markdown", reason="the docs hook is a Markdown extension: pip install -e '.[docs]'")


def rendered(text: str) -> str:
    import sys

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    return markdown.Markdown(extensions=[hooks.DoctestFenceExtension(), "fenced_code"]).convert(text)


def test_a_literal_block_marker_becomes_a_colon_and_code():
    html = rendered("The model, on ids::\n\n    x = wte[idx]        (B, T, C)\n\n    y = x @ W\n\nAfter it.\n")
    assert "::" not in html and "<p>The model, on ids:</p>" in html
    assert "x = wte[idx]        (B, T, C)\n\ny = x @ W" in html and "<p>After it.</p>" in html


def test_a_marker_alone_goes_and_one_without_a_block_stays():
    html = rendered("Shapes:\n\n::\n\n    (B, H, T, D)\n\nNot a marker:: here\n")
    assert "<p>::</p>" not in html and "(B, H, T, D)" in html and "Not a marker:: here" in html


def test_fenced_code_is_left_alone():
    html = rendered("```python\nd = {'a'::2}\n```\n")
    assert "{&#x27;a&#x27;::2}" in html or "{'a'::2}" in html


def test_every_api_page_names_its_module_once():
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text().splitlines()
        title = lines[0][2:].strip()
        block = lines.index(f"::: {title}")
        options = "\n".join(lines[block + 1:block + 4])
        assert "show_root_heading: false" in options, page.name
