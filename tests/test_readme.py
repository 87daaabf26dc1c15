"""The README's Python examples run as written, so the documentation cannot rot."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    if "qkv.models" in code:
        pytest.importorskip("safetensors", reason="the example needs qkv[models]")
        pytest.importorskip("tokenizers", reason="the example needs qkv[models]")
        pytest.importorskip("matplotlib", reason="the example needs qkv[viz]")
    if "qkv.torch" in code:
        pytest.importorskip("torch", reason="the example needs qkv[torch]")
    if "register_hf" in code:
        pytest.importorskip("transformers", reason="the example needs qkv[hf]")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})
