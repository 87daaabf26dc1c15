"""Progress of the long commands (``qkv.cli.progress``): a rich bar with the time left where
stderr is a terminal, a plain line every few seconds elsewhere, and rich asked for only where
a bar is drawn (``--no-progress`` needs none).

The commands run as a user runs them: in a subprocess whose stderr is a pipe or a terminal
(a pseudo-terminal), or through ``qkv.cli.main``. ``QKV_PROGRESS_INTERVAL`` makes the lines
come every few milliseconds instead of every 5 s; ``QKV_JIT=0`` spares the subprocesses the
compiled kernels' loading.
"""
import os
import re
import select
import subprocess
import sys
import time

import pytest

from qkv.cli import main, progress
from qkv.extras import MissingExtra

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2"]
LINE = re.compile(r"^(?P<label>[^:]+): (?P<done>\d+)/(?P<total>\d+), (?P<pct>\d+)%, (?P<elapsed>[\dhms]+) elapsed"
                  r"(, (?P<left>~[\dhms]+ left|done))?")


def _corpus(tmp_path) -> str:
    words = "the king my lord and of to a you is that in not me it his with be your for this".split()
    path = tmp_path / "play.txt"
    path.write_text("\n".join(f"KING:\n{' '.join(words[i % 7:i % 7 + 9])}." for i in range(300)))
    return str(path)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QKV_PROGRESS")}
    env.update(QKV_JIT="0", **extra)
    return env


def _on_terminal(args, env, timeout=60.0):
    """Run ``args`` with stdout and stderr on a pseudo-terminal; (exit status, what it showed,
    without the terminal's escape sequences)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    shown, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            shown.append(data)
        text = b"".join(shown).decode(errors="replace")
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


# --- the plain lines ---------------------------------------------------------------------------

def test_a_line_says_the_count_the_time_and_the_time_left():
    now = [100.0]
    lines = progress.Lines("gpt", 2000, ("loss",), clock=lambda: now[0])
    assert lines.line() == "gpt: 0/2000, 0%, 0s elapsed, loss —"  # no rate yet: no estimate
    now[0] += 72.0
    lines.update(120, loss=2.45121)
    # 120 steps in 72 s: the 1880 left take 1128 s
    assert lines.line() == "gpt: 120/2000, 6%, 1m12s elapsed, ~18m48s left, loss 2.4512"
    now[0] += 7200.0
    lines.update(1880, description="gpt: final")
    assert lines.line() == "gpt: final: 2000/2000, 100%, 2h01m elapsed, done, loss 2.4512"


def test_a_resumed_count_estimates_from_the_steps_of_this_process():
    now = [0.0]
    lines = progress.Lines("gpt", 1000, completed=900, clock=lambda: now[0])
    now[0] += 10.0
    lines.update(10)  # 10 steps in 10 s, 90 left: 90 s, not the 900 earlier steps' (absent) time
    assert lines.line() == "gpt: 910/1000, 91%, 10s elapsed, ~1m30s left"


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "inf"])
def test_a_bad_interval_is_refused_by_name(raw, monkeypatch, capsys):
    monkeypatch.setenv(progress.INTERVAL_ENV, raw)
    assert main(["train", "lookup", "--steps", "2"]) == 2
    assert f"QKV_PROGRESS_INTERVAL must be a number of seconds > 0; got {raw!r}" in capsys.readouterr().err


def test_train_gpt_into_a_pipe_writes_progress_lines(tmp_path):
    """Stderr a pipe (a log, CI): a line at the start, lines while it trains, one at the end."""
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    args = [sys.executable, "-m", "qkv", "train", "gpt", "--data", _corpus(tmp_path), "--out", str(tmp_path / "run"),
            "--steps", "300", "--eval-interval", "150", *TINY]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=_env(QKV_PROGRESS_INTERVAL="0.02"))
    assert proc.returncode == 0, proc.stderr
    found = [LINE.match(x) for x in proc.stderr.splitlines() if x.startswith("gpt:")]
    assert len(found) >= 3 and all(found), proc.stderr
    first, last = found[0], found[-1]
    assert (first["done"], first["total"], first["left"]) == ("0", "300", None)
    assert (last["done"], last["pct"], last["left"]) == ("300", "100", "done")
    assert any(m["left"] and m["left"].endswith(" left") for m in found[1:-1]), proc.stderr
    assert [int(m["done"]) for m in found] == sorted(int(m["done"]) for m in found)
    assert "loss " in found[-1].string and "tok/s " in found[-1].string
    assert "gpt:" not in proc.stdout  # standard output keeps the results only


def test_train_gpt_on_a_terminal_draws_a_bar_with_the_time_left(tmp_path):
    pytest.importorskip("rich", reason="the bar needs the cli extra: pip install -e '.[cli]'")
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    args = [sys.executable, "-m", "qkv", "train", "gpt", "--data", _corpus(tmp_path), "--out", str(tmp_path / "run"),
            "--steps", "20", "--eval-interval", "10", *TINY]
    status, shown = _on_terminal(args, _env(TERM="xterm", COLUMNS="200"))
    assert status == 0, shown
    assert re.search(r"gpt .*20/20.*\d+:\d\d:\d\d elapsed,\s+(\d+:\d\d:\d\d|-:--:--) left", shown), shown
    assert re.search(r"val \d\.\d{4} \(step (0|10|20)\)", shown), shown    # which step the val is from
    assert not re.search(LINE.pattern, shown, re.M)  # the bar, not the lines


def test_every_bench_suite_reports_progress_through_the_one_helper(capsys, monkeypatch):
    """`qkv bench` wraps every suite's steps in one count: the plain lines show the suite's step."""
    pytest.importorskip("rich", reason="qkv bench needs the cli extra (rich)")
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.01")
    assert main(["bench", "--quick", "--suite", "decode", "--no-torch", "--no-memory"]) == 0
    err = capsys.readouterr().err
    found = [LINE.match(x) for x in err.splitlines() if LINE.match(x)]
    assert found and found[0]["done"] == "0" and found[0]["label"] == "qkv bench", err
    assert found[-1]["left"] == "done" and found[-1]["done"] == found[-1]["total"] != "0", err


# --- rich only where a bar is drawn --------------------------------------------------------------

def _no_rich(tmp_path) -> str:
    """A folder that, first on PYTHONPATH, makes `import rich` fail as if it were not installed."""
    shim = tmp_path / "shim" / "rich"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'rich'\")\n")
    return str(shim.parent)


def test_train_gpt_without_rich_says_no_progress_works(tmp_path):
    """On a terminal, without rich: exit 2 at once, naming the extra and --no-progress; with
    --no-progress the same run trains."""
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    args = [sys.executable, "-m", "qkv", "train", "gpt", "--data", _corpus(tmp_path), "--steps", "3", *TINY]
    env = _env(TERM="xterm", PYTHONPATH=_no_rich(tmp_path))
    status, shown = _on_terminal([*args, "--out", str(tmp_path / "a")], env)
    assert status == 2, shown
    assert "pip install -e '.[cli]'" in shown and "--no-progress needs no rich" in shown, shown
    assert not (tmp_path / "a").exists()  # said before any work
    status, shown = _on_terminal([*args, "--out", str(tmp_path / "b"), "--no-progress"], env)
    assert status == 0, shown
    assert (tmp_path / "b" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", [["train", "lookup", "--steps", "2"],
                                     ["experiment", "recall", "--quick"]])
def test_other_commands_without_rich_name_no_progress(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    monkeypatch.setitem(sys.modules, "rich", None)  # `import rich` raises ImportError
    with pytest.raises(MissingExtra, match="--no-progress needs no rich"):
        progress.check_progress()
    if command[0] == "experiment":
        pytest.importorskip("matplotlib", reason="qkv experiment needs the viz extra")
        command = [*command, "--out", str(tmp_path)]
    assert main(command) == 2
    assert "--no-progress needs no rich" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
