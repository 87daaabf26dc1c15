"""The README is the front page: two commands first, links that lead somewhere.

Its Python examples run with every guide page's in tests/cli/test_docs.py.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def test_readme_starts_with_the_two_commands():
    """The first command sets up the light install (no torch) and runs the main job; the
    second is the test command exactly as .ci/run runs it."""
    first, second = [body.strip() for _, body in FENCED.findall(README.read_text())[:2]]
    assert first.startswith("python3 -m venv .venv && ") and first.endswith("&& .venv/bin/qkv explain"), first
    assert "'.[models,viz]'" in first and "[all]" not in first and "torch" not in first, first
    assert second in (ROOT / ".ci" / "run").read_text().splitlines(), second
    assert second.endswith(".venv/bin/python -m pytest -q") and "'.[all]'" in second


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"the README has {len(lines)} lines; the rest belongs in docs/"
    text = "\n".join(lines)
    for page in ("install", "attention", "layers", "models", "gpt", "torch", "mpi", "linear", "speed", "contributing"):
        assert f"(docs/{page}.md" in text, f"the README links to no docs/{page}.md"


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the guide pages"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_pages_repeat_the_readme_commands_verbatim():
    """A page that shows a set-up line (home, Install) shows one of the README's two, unchanged."""
    commands = {body.strip() for _, body in FENCED.findall(README.read_text())[:2]}
    shown = [(page.name, line.strip()) for page in sorted((ROOT / "docs").rglob("*.md"))
             for _, body in FENCED.findall(page.read_text()) for line in body.splitlines()
             if line.startswith("python3 -m venv .venv")]
    assert shown, "the guide shows the README's commands"
    drifted = [(page, line) for page, line in shown if line not in commands]
    assert not drifted, f"set-up lines that differ from the README's: {drifted}"
