"""The three rooms of a GPT (STYLE 21): the networks (``qkv.models``), the loop with its settings
and data (``qkv.training``), the files in and out (``qkv.io``); each import read off the source,
function-level imports included."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "qkv"


def imports(path: Path) -> set[str]:
    """The qkv modules ``path`` imports, as dotted names under qkv (relative imports resolved)."""
    pkg = path.relative_to(SRC.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{name}.{a.name}" for a in node.names)
            found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("qkv")}


def modules(room: str) -> list[Path]:
    return sorted((SRC / room).glob("*.py"))


def test_each_room_is_a_package_and_the_networks_are_few():
    for room in ("models", "io", "training"):
        assert (SRC / room / "__init__.py").is_file(), room
    assert len(modules("models")) <= 12, [p.name for p in modules("models")]


@pytest.mark.parametrize("room", ["models", "io", "training"])
def test_no_room_imports_the_command_line(room):
    for path in modules(room):
        bad = sorted(n for n in imports(path) if n == "qkv.cli" or n.startswith("qkv.cli."))
        assert not bad, f"{path.name} imports {bad}"


def test_the_networks_know_nothing_of_the_loop():
    for path in modules("models"):
        bad = sorted(n for n in imports(path) if n.startswith("qkv.training"))
        assert not bad, f"{path.name} imports {bad}"


def test_the_command_calls_the_session_once_and_nothing_of_the_loop():
    path = SRC / "cli" / "train_gpt.py"
    used = {n for n in imports(path) if n.startswith("qkv.training") or n.startswith("qkv.io")}
    assert used <= {"qkv.training.session", "qkv.training.session.Events", "qkv.training.session.Request",
                    "qkv.training.session.train_gpt", "qkv.training.config", "qkv.training.config.TrainConfig",
                    "qkv.io.nanoconfig", "qkv.io.nanoconfig.SETTINGS"}, used   # parsing: nanoGPT's spellings
    calls = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "train_gpt"]
    assert len(calls) == 2  # one process, or every rank under MPI: one call either way


def test_the_public_names_stay_where_users_import_them():
    models = pytest.importorskip("qkv.models")
    for name in ("GPT", "GPTConfig", "load_gpt", "load_gpt2", "load_bert", "Bert", "BertConfig", "CheckpointError",
                 "name_table", "default_model_path"):
        assert callable(getattr(models, name)), name
    from qkv.io.gpt_files import load_gpt
    assert models.load_gpt is load_gpt
