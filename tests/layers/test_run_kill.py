"""A save killed at any point (SIGKILL: no handler, no cleanup) leaves a run that resumes at the
checkpoint before it or at the new one, never a folder ``--resume`` refuses.

Each kill point is a line of the save's own code (qkv.models' save path: the run's files, the
staging folder, the commit, the renames): the save runs in a forked child that kills itself
when the tracer reaches its n-th line, for n = 1, 2, ... until a save completes unkilled.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

import qkv.io  # noqa: E402
import qkv.models  # noqa: E402
from qkv.cli import main  # noqa: E402
from helpers import text_corpus  # noqa: E402

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2", "--no-progress"]
# where a save's lines are (the run's files, qkv.io; GPT.save, qkv.models): a kill may land on any of them
SAVING = (str(Path(qkv.io.__file__).parent), str(Path(qkv.models.__file__).parent))
WEIGHT = "transformer.h.0.mlp.W_fc"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill loop forks a child per kill point")]


def _save_killed_at(run, folder: Path, n: int) -> bool:
    """Save ``run`` into ``folder`` in a child killed at the n-th line of the save; True if it was killed."""
    from qkv.io.runfiles import save_run

    pid = os.fork()
    if pid == 0:  # the child: trace the save's lines in qkv.io and qkv.models, die at the n-th
        count = [0]

        def line(frame, event, arg):
            if event == "line":
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return line

        def call(frame, event, arg):
            code = frame.f_code
            return line if code.co_filename.startswith(SAVING) and code.co_name != "_flatten" else None

        try:
            sys.settrace(call)
            save_run(run, folder)
        finally:
            sys.settrace(None)
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0
    return False


def _next_step(run, corpus: str):
    from qkv.training.chardata import CharDataset
    from qkv.training.loop import next_batch, train_step

    train_step(run, *next_batch(run, CharDataset(corpus, run.tokenizer)))
    return run


@pytest.mark.parametrize("first", [False, True], ids=["over a checkpoint", "the first save"])
def test_a_save_killed_at_every_point_resumes_at_the_old_or_the_new_checkpoint(tmp_path, first):
    """Before: killed between two of the renames, the folder held some new files and some old ones,
    and --resume refused it ("the files come from different saves") while the new checkpoint sat
    complete in .saving/."""
    from qkv.io.runfiles import load_run

    corpus = text_corpus(400)
    (tmp_path / "play.txt").write_text(corpus)
    base = tmp_path / "base"
    assert main(["train", "gpt", "--data", str(tmp_path / "play.txt"), "--out", str(base), *TINY,
                 "--steps", "2", "--eval-interval", "1"]) == 0
    old = load_run(base)
    if first:
        shutil.rmtree(base)
        base.mkdir()
    new = _next_step(load_run(tmp_path / "base") if not first else old, corpus)
    seen, n = set(), 0
    while True:
        n += 1
        folder = tmp_path / f"kill{n}"
        shutil.copytree(base, folder)
        killed = _save_killed_at(new, folder, n)
        if first and not (folder / "config.json").exists() and not (folder / ".saving" / "complete.json").exists():
            # nothing committed yet: the folder holds no run (--resume says so) and the staging is discarded
            seen.add("none")
            assert main(["train", "gpt", "--out", str(folder), "--resume", "--no-progress"]) == 2
        else:
            got = load_run(folder)  # what --resume reads
            assert got.step in (old.step if not first else None, new.step), f"killed at line {n}: step {got.step}"
            want = new if got.step == new.step else old
            seen.add("new" if want is new else "old")
            np.testing.assert_array_equal(got.model.params[WEIGHT], want.model.params[WEIGHT])
            assert got.log == want.log and got.opt.t == want.opt.t
        assert not (folder / ".saving").exists()
        shutil.rmtree(folder)
        if not killed:
            break
        assert n < 500, "the save never completed"
    assert n > 10 and seen == ({"none", "new"} if first else {"old", "new"}), (n, seen)


def test_resume_completes_a_first_save_killed_after_its_commit(tmp_path, capsys):
    """The first save of a run, killed after its commit but before config.json moved: --resume
    finds the run (before: "holds no run (no config.json)") and continues it."""
    from qkv.io.runfiles import load_run

    (tmp_path / "play.txt").write_text(text_corpus(400))
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(tmp_path / "play.txt"), "--out", str(out), *TINY, "--steps", "1"]) == 0
    run = load_run(out)
    shutil.rmtree(out)
    out.mkdir()
    n, killed_after_commit = 0, False
    while not killed_after_commit:
        n += 1
        shutil.rmtree(out)
        out.mkdir()
        assert _save_killed_at(run, out, n), "the save completed before config.json moved"
        killed_after_commit = (out / ".saving" / "complete.json").exists() and not (out / "config.json").exists() \
            and not (out / ".saving" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "2", "--no-progress"]) == 0
    assert load_run(out).step == 2 and not (out / ".saving").exists()
