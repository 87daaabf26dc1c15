"""What the command says about itself (issue 54): a misspelt flag gets its subcommand's usage
and the nearest flag; an error names the whole subcommand; the help lists every experiment and
bench suite from the registries the command runs; the default output folders are ignored by git."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qkv.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_an_unknown_flag_gets_the_subcommands_usage_and_the_nearest_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "gpt", "--setps", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: qkv train gpt ")
    assert "unrecognized arguments: --setps" in err and "did you mean --steps?" in err
    with pytest.raises(SystemExit):
        main(["sample", "out-gpt", "--tokns", "3"])
    assert "usage: qkv sample" in (err := capsys.readouterr().err) and "did you mean --tokens?" in err


def test_an_error_of_train_gpt_names_train_gpt(capsys):
    assert main(["train", "gpt", "--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("qkv train gpt: error: --steps must be an int >= 1")


def _help(*words) -> str:
    parser = build_parser()
    for w in words:
        parser = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[w]
    return parser.format_help()


def test_help_lists_every_experiment_and_suite_with_a_line():
    from qkv.cli.experiment import EXPERIMENTS

    text = _help("experiment")
    assert set(EXPERIMENTS) == {"scale", "complexity", "recall", "mqar"}
    for name in EXPERIMENTS:
        assert re.search(rf"^\s+{name}\s+\S", text, re.M), name
        assert name in _help()                       # qkv --help's line for experiment names them all
    suites = pytest.importorskip("qkv_benchmarks.suites")
    assert set(suites.SUITE_HELP) == set(suites.SUITES)
    text = _help("bench")
    for name in suites.SUITES:
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(suites.SUITE_HELP[name][:20])}", text, re.M), name


def test_the_default_output_folders_are_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md")) + (ROOT / "README.md").read_text()
    named = set(re.findall(r"--out (out-[\w-]+)", docs)) | {"out-gpt", "experiment-out", "explain-out"}
    for folder in sorted(named):
        probe = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", f"{folder}/model.safetensors"])
        assert probe.returncode == 0, f"{folder}/ is not in .gitignore"
