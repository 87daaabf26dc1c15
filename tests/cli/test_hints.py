"""Hints that point the right way (issue 61): nanoGPT's spellings taken, no abbreviation taken for a
flag, a mistyped local folder called one (not a hub id), install lines that work from a fresh clone,
and a resumed finished run that says so instead of "0 steps this time"."""
import pytest

from qkv.cli import build_parser, main
from qkv.extras import MissingExtra, require

TINY = ["--block-size", "8", "--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "8",
        "--eval-iters", "1", "--warmup", "1", "--no-progress"]


def parsed(*argv):
    args, unknown = build_parser().parse_known_args(list(argv))
    return args, unknown


@pytest.mark.parametrize("nano,field,value", [("--max_iters", "steps", 3), ("--batch_size", "batch_size", 12),
                                              ("--n_layer", "n_layer", 6), ("--learning_rate", "lr", 6e-4),
                                              ("--lr_decay_iters", "lr_decay_steps", 500), ("--out_dir", "out", "o"),
                                              ("--gradient_accumulation_steps", "grad_accum", 4)])
def test_nanogpts_spellings_are_the_flags_they_map_to(nano, field, value):
    args, unknown = parsed("train", "gpt", nano, str(value))
    assert not unknown and getattr(args, field) == value


def test_nanogpts_spellings_stay_out_of_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "gpt", "--help"])
    shown = capsys.readouterr().out
    assert "--max_iters 600 is --steps 600" in shown and "--batch_size X" not in shown


@pytest.mark.parametrize("argv,flag", [(["train", "gpt", "--step", "5"], "--steps"),
                                       (["train", "gpt", "--eval-int", "5"], "--eval-interval"),
                                       (["bench", "--quic"], "--quick"),
                                       (["sample", "out", "--temp", "0"], "--temperature")])
def test_no_flag_is_taken_from_an_abbreviation(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unrecognized arguments" in err and f"did you mean {flag}?" in err


@pytest.mark.parametrize("name", ["./out-nothing", "../elsewhere/run", "a/b/c", "/no/such/run"])
def test_a_missing_local_folder_is_no_such_folder(capsys, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert main(["sample", name]) == 2
    err = capsys.readouterr().err
    assert f"no such folder: {name!r}" in err and "snapshot_download" not in err and "Hugging Face" not in err


def test_a_name_that_looks_like_a_hub_id_says_both_where_it_looked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert main(["sample", "out-nothing"]) == 2
    err = capsys.readouterr().err
    assert "there is no folder 'out-nothing' here" in err and "Hugging Face cache" in err


def test_install_lines_work_from_a_clone():
    with pytest.raises(MissingExtra, match=r"pip install -e '\.\[viz\]' \(in qkv's folder"):
        require("no_such_module_qkv_test", "viz")


def test_a_finished_run_resumed_says_so_and_writes_nothing(capsys, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("to be or not to be\n" * 40)
    assert main(["train", "gpt", "--data", "t.txt", "--out", "run", "--steps", "2", "--eval-interval", "2",
                 *TINY]) == 0
    stamp = (tmp_path / "run" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["train", "gpt", "--out", "run", "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "at step 2 of 2 already: nothing to train" in out and "0 steps" not in out and "wrote" not in out
    assert (tmp_path / "run" / "model.safetensors").stat().st_mtime_ns == stamp
