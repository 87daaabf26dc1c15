"""No module of qkv uses a private name (``_x``) of a module in another qkv package: what one
package needs from another is public there, documented and tested (the layers' prepared call
is ``qkv.api.prepare_call``, not ``api._kernel``/``_forward``/``_backward``). A scan of
src/qkv's syntax trees: ``from X import _y``, and ``X._y`` where the name X is bound to a qkv
module (``from .. import api``, ``import qkv.threads as threads``, ``qkv.threads._y``)."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict:
    mods = {}
    for path in sorted((SRC / "qkv").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()


def package(module: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _source(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    parts = package(module).split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _dotted(node) -> str | None:
    """``a.b.c`` of a chain of attributes on a name, or None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id] + names[::-1]) if isinstance(node, ast.Name) else None


def crossings(module: str, tree: ast.AST) -> list[str]:
    """Each use in ``module`` of a private name of a qkv module in another package."""
    found, bound = [], {}   # bound: local name -> the qkv module it names
    foreign = lambda target: target in MODULES and package(target) != package(module)  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source(module, node)
            for alias in node.names:
                full = f"{src}.{alias.name}"
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                elif private(alias.name) and foreign(src):
                    found.append(f"line {node.lineno}: from {src} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    bound[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            target = bound.get(head, head) + (f".{rest}" if rest else "")
            if foreign(target):
                found.append(f"line {node.lineno}: {owner}.{node.attr} ({target})")
    return found


def test_no_module_uses_a_private_name_of_another_package():
    found = {m: crossings(m, ast.parse(p.read_text())) for m, p in MODULES.items()}
    assert {m: f for m, f in found.items() if f} == {}


def test_the_scan_finds_each_kind_of_crossing():
    """The scan itself: the three spellings it must catch, and what it must let pass."""
    code = ("from .. import api\nfrom ..threads import _controller\nimport qkv.threads as th\nimport qkv.api\n"
            "from .reference import _expand_groups\n"
            "def f():\n    api._kernel(); th._here; qkv.api._forward(); api.prepare_call(); api.__doc__\n")
    found = crossings("qkv.nn.attention_layer", ast.parse(code))
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "api._kernel (qkv.api)", "from qkv.threads import _controller", "qkv.api._forward (qkv.api)",
        "th._here (qkv.threads)"]
    assert len(crossings("qkv.kernels.stacked", ast.parse("from .. import api\napi._kernel()\n"))) == 1
    assert crossings("qkv.kernels.stacked", ast.parse("from .reference import _expand_groups\n")) == []  # one package
