"""The README and the guide pages (docs/) stay true: their code runs as written.

- every ```python block of every page runs (in a temporary folder, skipped with the reason
  where its extra is missing);
- every `qkv ...` line of every ```bash block parses with the command's own parser (options
  that no longer exist fail here; nothing is run);
- (the README's own checks, its two commands and its links, are in tests/cli/test_readme.py; MkDocs
  checks the pages' links: `mkdocs build --strict` in .ci/run);
- the benchmark tables between `<!-- bench: NAME -->` markers are what docs/tables.py makes
  from docs/bench/NAME.json.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[tuple[str, int, str]]:
    """``(page, index, code)`` of every fenced block of ``lang`` on every page."""
    found = []
    for page in PAGES:
        code = [body for tag, body in FENCED.findall(page.read_text()) if tag == lang]
        found += [(str(page.relative_to(ROOT)), i, c) for i, c in enumerate(code)]
    return found


PYTHON = blocks("python")
BASH = blocks("bash")


def test_pages_have_examples():
    assert len(PYTHON) >= 10 and len(BASH) >= 8
    assert {page for page, _, _ in PYTHON} >= {"docs/attention.md", "docs/layers.md", "docs/models.md",
                                               "docs/torch.md", "docs/linear.md"}


@pytest.mark.parametrize("page, index, code", PYTHON, ids=[f"{p}:{i}" for p, i, _ in PYTHON])
def test_python_block_runs(page, index, code, tmp_path, monkeypatch):
    if "qkv.models" in code:
        pytest.importorskip("safetensors", reason="the example needs qkv[models]")
        pytest.importorskip("tokenizers", reason="the example needs qkv[models]")
        pytest.importorskip("matplotlib", reason="the example needs qkv[viz]")
    if "qkv.torch" in code or "import torch" in code:
        pytest.importorskip("torch", reason="the example needs qkv[torch]")
    if "register_hf" in code or "from transformers" in code:
        pytest.importorskip("transformers", reason="the example needs qkv[hf]")
    if "distributed" in code:
        pytest.importorskip("mpi4py", reason="the example needs qkv[mpi]")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "docs"})


@functools.cache
def qkv_parser():
    from qkv.cli import build_parser
    return build_parser()


def qkv_argv(line: str) -> list[str] | None:
    """The arguments after ``qkv`` of a shell line that runs the command (through ``env``,
    ``mpiexec -n W``, ``python -m mpi4py -m qkv`` or a venv's ``bin/qkv``), else None.
    ``...`` stands for "more options" in the pages and is left out."""
    words = [w for w in shlex.split(line, comments=True) if w != "..."]
    while words:
        w = words[0]
        if w == "env" or "=" in w:
            words = words[1:]
        elif w == "-u" or w == "-n" or w == "-np":
            words = words[2:]
        elif w == "mpiexec":
            words = words[1:]
        elif w in ("python", "python3") and words[1:5] == ["-m", "mpi4py", "-m", "qkv"]:
            return words[5:]
        elif Path(w).name == "qkv":
            return words[1:]
        else:
            return None
    return None


def bash_lines():
    for page, index, code in BASH:
        for line in code.replace("\\\n", " ").splitlines():
            for command in line.split("#")[0].split("&&"):  # each command of `a && b`
                argv = qkv_argv(command)
                if argv is not None:
                    yield pytest.param(command, argv, id=f"{page}:{index}:{' '.join(argv[:3])}")


@pytest.mark.parametrize("line, argv", list(bash_lines()))
def test_qkv_line_parses(line, argv):
    try:
        args = qkv_parser().parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, f"`{line.strip()}` does not parse with qkv's own parser (see above)"
        return
    assert getattr(args, "_run", None), f"`{line.strip()}` names no subcommand"


def test_qkv_lines_found():
    lines = [line for line, _ in (p.values for p in bash_lines())]
    assert any("qkv bench" in line for line in lines) and any("qkv train gpt" in line for line in lines)
    assert any("mpiexec" in line for line in lines)


@functools.cache
def tables_module():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "docs" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_tables_are_generated():
    """Each marked block equals what the script renders from its stored JSON (rerun
    `python docs/tables.py` after recording a measurement or changing the script)."""
    tables = tables_module()
    pages = tables.pages()
    assert ROOT / "docs" / "speed.md" in pages
    for page in pages:
        text = page.read_text()
        assert tables.regenerate(text) == text, f"{page.name} is stale: run python docs/tables.py"


def test_bench_records_say_command_and_machine():
    tables = tables_module()
    marks = [m for page in tables.pages() for m in tables.BLOCK.finditer(page.read_text())]
    names = {m.group("name") for m in marks if m.group("kind") == "bench"}
    assert names
    for m in marks:  # an experiment's marker names the command that wrote its JSON (a variant: name-suffix)
        if m.group("kind") == "experiment":
            experiment = m.group("name").split("-")[0]
            assert m.group("command").startswith(f"qkv experiment {experiment}"), m.group(0)
    for name in names:
        record = tables.load(name)
        assert record["command"].startswith("qkv bench ") and "--json" not in record["command"]
        assert record["machine"]["cores"] >= 1 and record["recorded"].endswith("UTC")
        rendered = tables.render(record)
        assert "machine: " in rendered and record["command"] in rendered


def test_a_changed_record_makes_the_page_stale(tmp_path):
    """The check can fail: a number changed in the JSON shows up as a stale page."""
    tables = tables_module()
    page = tables.DOCS / "speed.md"
    name = tables.BLOCK.search(page.read_text()).group("name")
    record = tables.load(name)
    suite = next(k for k in ("shapes", "main", "torch_suite", "gpt", "hf") if record.get(k))
    key = next(k for k, v in record[suite][0].items() if isinstance(v, float))
    record[suite][0][key] *= 3.0
    for other in tables.BENCH.glob("*.json"):                    # the page's other records as they are
        (tmp_path / other.name).write_text(other.read_text())
    (tmp_path / f"{name}.json").write_text(json.dumps(record))
    assert tables.regenerate(page.read_text(), bench=tmp_path) != page.read_text()


def _hooks():
    """docs/hooks.py, loaded with a stand-in for Markdown's two base classes where MkDocs (the
    ``docs`` extra) is not installed: the role renderer itself needs neither."""
    import importlib.util
    import types

    try:
        import markdown  # noqa: F401
    except ImportError:
        stub = types.ModuleType("markdown")
        stub.Extension = type("Extension", (), {})
        pre = types.ModuleType("markdown.preprocessors")
        pre.Preprocessor = type("Preprocessor", (), {"__init__": lambda self, md=None: None})
        sys.modules.setdefault("markdown", stub)
        sys.modules.setdefault("markdown.preprocessors", pre)
    spec = importlib.util.spec_from_file_location("qkv_docs_hooks", ROOT / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docstring_roles_render_as_links_or_code_never_as_raw_text():
    """The API reference showed 225 raw Sphinx roles (``:class:`Linear```). Each role becomes an
    autorefs cross-reference (a whole qkv path: a link where the reference renders it) or code."""
    hooks = _hooks()
    pre = hooks.SphinxRoles(None)
    lines = pre.run(["See :func:`qkv.attention` and :mod:`~qkv.kernels.reference`, :class:`.Tiles`, :data:`MAX_KEYS`.",
                     "```python", ":func:`inside_a_fence`", "```"])
    assert lines[0] == ('See <autoref identifier="qkv.attention" optional><code>qkv.attention</code></autoref> and '
                        '<autoref identifier="qkv.kernels.reference" optional><code>reference</code></autoref>, '
                        '<code>Tiles</code>, <code>MAX_KEYS</code>.')
    assert lines[2] == ":func:`inside_a_fence`"          # code blocks are left alone


def test_every_docstring_role_is_one_the_renderer_takes():
    """One convention: the roles the docs hook renders, nothing else (a :ref: or :py:func: would
    reach the page as raw text)."""
    import re

    hooks = _hooks()
    roles = re.compile(r"(?<![\w`]):([a-z:]+):`")
    unknown = set()
    for path in (ROOT / "src" / "qkv").rglob("*.py"):
        for m in roles.finditer(path.read_text()):
            if not hooks.ROLE.match(path.read_text(), m.start()):
                unknown.add(f"{path.relative_to(ROOT)}: :{m.group(1)}:")
    assert not unknown, sorted(unknown)[:10]


def test_the_docs_figures_are_their_records():
    """Install sizes and compile costs are quoted from their records (docs/bench/install.json:
    du -sm of fresh environments; docs/bench/cold.json: `qkv bench --suite cold`), so prose and
    measurement cannot drift apart again (the README said 1.6 GB for 1.8; the compile cost was
    65 s in one page, 25-40 s in another, 10 and 13 s in the notice)."""
    from qkv import jit_cache

    install = json.loads((ROOT / "docs" / "bench" / "install.json").read_text())
    cold = {j["job"]: j["cold"] for j in json.loads((ROOT / "docs" / "bench" / "cold.json").read_text())["cold"]}
    all_gb, light_mb = f"{install['mib']['all'] / 1024:.1f} GB", f"{install['mib']['light']} MB"
    readme, install_md, gpt = ((ROOT / p).read_text() for p in ("README.md", "docs/install.md", "docs/gpt.md"))
    for text, where in ((readme, "README.md"), (install_md, "docs/install.md")):
        rows = [line for line in text.splitlines() if "'.[all]'" in line and "GB" in line]
        assert rows and all(all_gb in line for line in rows), (where, all_gb, rows)
        assert light_mb in text, (where, light_mb)
    assert f"every extra, {all_gb}" in readme
    train = cold["train-gpt"]["compiled"]
    train_s = f"about {sum(train.values()):.0f} s"
    assert f"{train_s} for `qkv train gpt`'s" in readme and f"backward, {train_s} of CPU" in gpt
    rows = cold["attention"]["compiled"]
    fwd = next(s for n, s in rows.items() if "forward" in n)
    bwd = next(s for n, s in rows.items() if "backward" in n)
    assert jit_cache.ROW_KERNEL_CPU_S == (round(fwd), round(bwd))
    assert f"about {round(fwd)} and {round(bwd)} s" in jit_cache.ROW_KERNEL_ABOUT
