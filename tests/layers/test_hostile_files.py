"""Files from outside are hostile until checked (issue 62, items 4, 6 and 7): ``qkv convert`` never
replaces what it did not make; a config file, a ``ckpt.pt`` or a GPT-2 folder whose claims are
damaged, huge or deep is a clear ``qkv ...: error:`` line within seconds, never a traceback, a
hang or an allocation of what the file claims; and a fuzzer over all of them."""
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="qkv convert and sample read safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402
from qkv.errors import ShapeError  # noqa: E402
from qkv.io.checkpoint import CheckpointError, read_json  # noqa: E402
from qkv.io.nanoconfig import read_config_file, read_override  # noqa: E402
from qkv.models import GPT, GPTConfig, load_gpt, load_gpt2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A saved GPT with a character vocabulary, as qkv train gpt leaves one (exact GELU: nanoGPT's)."""
    folder = tmp_path_factory.mktemp("run") / "run"
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=8, activation="gelu", seed=3)
    GPT(cfg).save(folder, extra={"tokenizer": {"kind": "char", "chars": "\n abcdefghij"}})
    return folder


def convert(*args, capsys):
    code = main(["convert", *map(str, args)])
    return code, capsys.readouterr()


# --- item 4: convert never replaces what it did not make ------------------------------------------

def test_convert_refuses_an_existing_ckpt_and_meta_and_changes_nothing(run_folder, tmp_path, capsys):
    pytest.importorskip("torch")
    (tmp_path / "ckpt.pt").write_bytes(b"another model")
    code, out = convert(run_folder, tmp_path / "ckpt.pt", capsys=capsys)
    assert code == 2 and "already exists" in out.err and "--force" in out.err
    assert (tmp_path / "ckpt.pt").read_bytes() == b"another model" and not (tmp_path / "meta.pkl").exists()
    # a meta.pkl of another vocabulary beside a free ckpt.pt: refused before either is written
    (tmp_path / "ckpt.pt").unlink()
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 2, "itos": {0: "x", 1: "y"}}))
    before = tree_digest(tmp_path)
    code, out = convert(run_folder, tmp_path / "ckpt.pt", capsys=capsys)
    assert code == 2 and "meta.pkl" in out.err and tree_digest(tmp_path) == before
    code, out = convert(run_folder, tmp_path / "ckpt.pt", "--force", capsys=capsys)
    assert code == 0 and (tmp_path / "ckpt.pt").stat().st_size > 1000
    # its own meta.pkl again, the same bytes: not a conflict (but ckpt.pt is there now)
    os.replace(tmp_path / "ckpt.pt", tmp_path / "kept.pt")
    assert convert(run_folder, tmp_path / "ckpt.pt", capsys=capsys)[0] == 0


def test_convert_to_hf_refuses_a_folder_that_holds_files(run_folder, tmp_path, capsys):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"theirs")
    (dst / "README.md").write_text("their notes")
    before = tree_digest(dst)
    code, out = convert(run_folder, dst, "--to", "hf", capsys=capsys)
    assert code == 2 and "model.safetensors" in out.err and "did not write" in out.err
    assert tree_digest(dst) == before
    code, out = convert(run_folder, dst, "--to", "hf", "--force", capsys=capsys)
    assert code == 0 and "left as they were" in out.out and "README.md" in out.out
    assert (dst / "model.safetensors").read_bytes() != b"theirs" and (dst / "README.md").read_text() == "their notes"


def test_convert_to_a_new_folder_leaves_nothing_half_made(run_folder, tmp_path, capsys, monkeypatch):
    from qkv.io import tensorfiles

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tensorfiles, "write_tensors", broken)
    code, out = convert(run_folder, tmp_path / "hf", "--to", "hf", capsys=capsys)
    assert code == 2 and "No space left" in out.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []   # neither the folder nor its hidden sibling


@pytest.mark.parametrize("where", ["file", "long"])
def test_convert_onto_a_file_or_an_impossible_name_is_an_error_line(run_folder, tmp_path, capsys, where):
    dst = tmp_path / ("x" * 300 if where == "long" else "a-file")
    if where == "file":
        dst.write_text("mine")
    code, out = convert(run_folder, dst, "--to", "hf", capsys=capsys)
    assert code == 2 and out.err.startswith("qkv convert: error:") and "Traceback" not in out.err
    assert where == "long" or dst.read_text() == "mine"


# --- item 6: sizes checked against the tensors before anything is allocated -----------------------

@pytest.mark.parametrize("field,value", [("vocab_size", 200_000_000), ("block_size", 10 ** 7), ("n_layer", 10 ** 9),
                                         ("n_embd", 10 ** 6)])
def test_a_saved_gpt_claiming_huge_sizes_is_refused_before_allocating(run_folder, tmp_path, field, value):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((run_folder / "model.safetensors").read_bytes())
    meta = json.loads((run_folder / "config.json").read_text())
    meta["config"][field] = value
    (bad / "config.json").write_text(json.dumps(meta))
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"{field} = {value}, but the tensors hold"):
        load_gpt(bad)
    assert time.perf_counter() - t < 2


@pytest.mark.parametrize("field", ["vocab_size", "n_positions", "n_layer", "n_embd"])
def test_a_gpt2_config_claiming_huge_sizes_is_refused_before_allocating(tmp_path, field):
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=True)
    from qkv.io.convert import folder_to_gpt2
    GPT(cfg).save(tmp_path / "run", extra={})
    folder_to_gpt2(tmp_path / "run", tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw[field] = 10 ** 9
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="but the tensors hold"):
        load_gpt2(tmp_path / "hf")
    assert time.perf_counter() - t < 2


def test_a_config_json_nested_too_deeply_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_json(path)


@pytest.mark.parametrize("body", [
    "n_layer = (((10**64)**64)**64)**64",
    "n_layer = " + "+".join(["1"] * 200_000),
    "n_layer = " + "-" * 100_000 + "1",
    "n_layer = " + "(" * 100_000 + "1" + ")" * 100_000,
    "n_layer = (" + "\n+".join(["1"] * 150_000) + ")",
    "n_layer = 1e400",
    "n_layer = 2**63",
    "n_layer = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
])
def test_a_hostile_config_file_is_refused_within_a_second(tmp_path, body):
    path = tmp_path / "cfg.py"
    path.write_text(body + "\n")
    t = time.perf_counter()
    with pytest.raises(ShapeError, match=str(path)):
        read_config_file(path)
    assert time.perf_counter() - t < 1


def test_nanogpt_settings_within_the_budget_still_read():
    assert read_override("--max_iters=5000")[1] == 5000
    assert read_override("--learning_rate=6e-4")[1] == 6e-4
    assert read_override("--dataset=shakespeare_char")[1] == "shakespeare_char"
    assert read_override("--max_iters=5*8")[1] == "5*8"   # nanoGPT's literal_eval: no arithmetic here
    with pytest.raises(ShapeError, match="--n_layer"):
        read_override("--n_layer=" + "9" * 5000)


# --- item 7: each a `qkv ...: error:` line naming the argument ------------------------------------

@pytest.mark.parametrize("args,said", [
    (["--seed", "-1"], "--seed"),
    (["--prompt", "\udcff\udcfe"], "--prompt"),
])
def test_sample_refuses_bad_arguments_by_name(run_folder, capsys, args, said):
    code = main(["sample", str(run_folder), "--tokens", "2", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("qkv sample: error:") and said in err


def test_sample_of_an_impossible_name_is_an_error_line(tmp_path, capsys):
    code = main(["sample", str(tmp_path / ("x" * 300))])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("qkv sample: error:")


# --- the fuzzer: damaged copies of each file, never a traceback, a hang or a changed file ---------

def _damaged(data: bytes, rng: np.random.Generator) -> bytes:
    kind = rng.integers(4)
    if kind == 0 and data:                                  # cut short
        return data[:rng.integers(len(data))]
    if kind == 1 and data:                                  # bytes flipped
        out = bytearray(data)
        for i in rng.integers(len(out), size=rng.integers(1, 9)):
            out[i] ^= 1 << int(rng.integers(8))
        return bytes(out)
    if kind == 2:                                           # a number made huge
        return data.replace(b"8", b"8" + b"9" * int(rng.integers(1, 40)), 1)
    return bytes(rng.integers(256, size=int(rng.integers(0, 64)), dtype=np.uint8)) + data[:32]


def _fuzz(run_folder, tmp_path, cases: int, seed: int):
    """Damaged copies of a saved GPT's config.json and model.safetensors, of a GPT-2 folder and of a
    nanoGPT config file, each read by the loader that takes it: a clear error or a model, within 2 s."""
    rng = np.random.default_rng(seed)
    from qkv.io.convert import folder_to_gpt2
    hf = tmp_path / "hf"
    folder_to_gpt2(run_folder, hf)
    sources = [(run_folder, "config.json", load_gpt), (run_folder, "model.safetensors", load_gpt),
               (hf, "config.json", load_gpt2), (hf, "model.safetensors", load_gpt2)]
    cfg_text = b"batch_size = 12\nblock_size = 64\nn_layer = 4\nlearning_rate = 1e-3\nmax_iters = 2000\n"
    outcomes = {"refused": 0, "read": 0}
    for case in range(cases):
        folder = tmp_path / f"case{case}"
        if case % 5 == 4:
            folder.mkdir()
            (folder / "cfg.py").write_bytes(_damaged(cfg_text, rng))
            reader, target = (lambda f: read_config_file(f / "cfg.py")), folder / "cfg.py"
        else:
            src, name, reader = sources[case % 4]
            folder.mkdir()
            for p in src.iterdir():
                (folder / p.name).write_bytes(p.read_bytes())
            (folder / name).write_bytes(_damaged((src / name).read_bytes(), rng))
            target = folder / name
        before = target.read_bytes()
        t = time.perf_counter()
        try:
            reader(folder)
            outcomes["read"] += 1
        except ShapeError as err:   # CheckpointError, ShapeError: a message naming the file or the setting
            assert str(err), "an empty message"
            outcomes["refused"] += 1
        assert time.perf_counter() - t < 2, f"case {case} took {time.perf_counter() - t:.1f} s"
        assert target.read_bytes() == before
    assert outcomes["refused"] > cases // 3, outcomes   # the damage was real


def test_fuzzed_files_are_refused_clearly_and_quickly(run_folder, tmp_path):
    _fuzz(run_folder, tmp_path, cases=150, seed=0)


@pytest.mark.slow
def test_fuzzed_files_at_length(run_folder, tmp_path):
    _fuzz(run_folder, tmp_path, cases=3000, seed=1)


@pytest.mark.slow
def test_fuzzed_nanogpt_checkpoints_through_the_command(run_folder, tmp_path):
    """Damaged copies of a ckpt.pt through ``qkv convert`` in a fresh process: exit 2 with an error
    line (or 0 with a model), never a traceback, and the destination folder alone written."""
    pytest.importorskip("torch")
    assert main(["convert", str(run_folder), str(tmp_path / "ckpt.pt")]) == 0
    data, rng = (tmp_path / "ckpt.pt").read_bytes(), np.random.default_rng(2)
    for case in range(12):
        bad = tmp_path / f"bad{case}.pt"
        bad.write_bytes(_damaged(data, rng))
        proc = subprocess.run([sys.executable, "-m", "qkv", "convert", str(bad), str(tmp_path / f"out{case}")],
                              capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.returncode == 0 or proc.stderr.startswith("qkv convert: error:")


def test_a_model_the_memory_cannot_hold_is_refused_by_its_figures(run_folder, monkeypatch):
    from qkv import heap

    monkeypatch.setattr(heap, "available_memory", lambda: 1000)   # 1000 bytes: no model fits
    with pytest.raises(CheckpointError, match=r"weights needs about .* GiB more memory to load; this machine has"):
        load_gpt(run_folder)
