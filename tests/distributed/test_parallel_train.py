"""qkv.distributed.train: the GPT trained by W ranks equals one process (tests/distributed/mpi_train_cases.py
under real ``mpiexec -n W python -m mpi4py`` jobs), and the checks that need no MPI job."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.distributed.train import check_split

from helpers import mpiexec

pytestmark = pytest.mark.slow  # subprocesses, mpiexec or compilers: the slow leg (pytest -m slow)

HERE = Path(__file__).parent
CASES = ("data-float64-20-steps", "context-float64-20-steps", "data-float32-20-steps",
         "context-float32-20-steps", "context-rope-gqa-grads", "saved-by-W-resumed-by-1",
         "saved-by-1-resumed-by-W")


def _launch(size, folder, *args, timeout=120):
    return mpiexec(size, "-m", "mpi4py", str(HERE / "mpi_train_cases.py"), str(folder), *args, timeout=timeout)


@pytest.mark.parametrize("size", [2, 3])
def test_parallel_training_equals_one_process(size, tmp_path):
    """float64: 20 steps of data parallel (W ranks x batch 2 against one process x batch 2W) and
    of context parallel give the losses, evaluations and weights of one process to 1e-10
    (float32 to 1e-5); RoPE + GQA context-parallel gradients equal one process's; a checkpoint
    written by W ranks resumes on one process and one written by one process resumes on W."""
    res = _launch(size, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    ok = [line for line in res.stdout.splitlines() if " ok " in line]
    for case in CASES:
        seen = [line for line in ok if f" ok {case} " in line]
        assert len(seen) == (1 if case == "saved-by-W-resumed-by-1" else size), (case, res.stdout)


def test_a_failing_rank_ends_the_job(tmp_path):
    """A batch W ranks cannot split, and runs that differ between ranks, raise the same error on
    every rank before any step; then one rank
    raising mid-training (the others in the Allreduce) ends the job with a non-zero status
    within the timeout, instead of a hang."""
    res = _launch(2, tmp_path, "fail", timeout=60)
    raised = sorted({line.split(" raised: ")[1] for line in res.stdout.splitlines() if " raised: " in line})
    assert len(raised) == 2, res.stdout + res.stderr
    assert raised[0].startswith("OptionError: parallelize: every rank must pass the same config; got rank 0: ")
    assert raised[1] == ("ShapeError: parallelize (rank 0 of 2): batch_size = 5 must be a multiple of the W = 2 "
                         "ranks: data parallel gives each rank batch_size / W rows of every batch")
    assert res.returncode != 0 and "rank 1 fails at step 3" in res.stderr
    assert "finished" not in res.stdout


@pytest.mark.parametrize("args,match", [
    (("data", 12, 64, 5), "batch_size = 12 must be a multiple of the W = 5 ranks"),
    (("context", 12, 60, 4), "block_size = 60 must be a multiple of 8 for context parallel over W = 4"),
    (("context", 12, 62, 4, "contiguous"), "block_size = 62 must be a multiple of 4"),
    (("pipeline", 12, 64, 2), "parallel must be one of"),
    (("data", 12, 64, 2, "stripes"), "layout must be one of"),
])
def test_splits_that_cannot_be_made_name_the_argument(args, match):
    with pytest.raises(qkv.ShapeError, match=match):
        check_split(*args)
    check_split("data", 12, 60, 4)   # batch 12 splits over 4; the block is not data parallel's concern
    check_split("context", 5, 64, 4)


def test_one_process_is_w_equals_one():
    """Without mpiexec (W = 1, mpi4py's singleton) both modes give the plain GPT's loss and grads."""
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py with mpich) is not installed")
    from qkv.distributed.train import ParallelGPT
    from qkv.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8, dtype=np.float64)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 11, (3, 16)), rng.integers(0, 11, (3, 16))
    one = GPT(cfg)
    want = one.loss(x, y)
    one.backward()
    for mode in ("data", "context"):
        par = ParallelGPT(GPT(cfg), mode)
        assert abs(par.loss(x, y) - want) < 1e-12
        par.backward()
        assert all(np.allclose(par.grads[k], g, rtol=0, atol=1e-12) for k, g in one.grads.items())
        with pytest.raises(qkv.ShapeError, match="idx has T = 20 tokens, more than block_size = 16"):
            ParallelGPT(GPT(cfg), "context").loss(np.zeros((1, 20), int), np.zeros((1, 20), int))


# --------------------------------------------------------------------------- qkv train gpt under mpiexec
TINY = ["--batch-size", "6", "--block-size", "12", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-interval", "3", "--eval-iters", "2", "--warmup", "2", "--lr", "1e-2", "--lr-decay-steps", "8",
        "--dtype", "float64", "--no-progress"]
FAIL_AT_STEP_2 = """import sys
from mpi4py import MPI
import qkv.training.loop as training
if MPI.COMM_WORLD.Get_rank() == 1:
    step = training.train_step
    def broken(run, x, y):
        if run.step == 2:
            raise RuntimeError("rank 1 fails at step 2")
        return step(run, x, y)
    training.train_step = broken
from qkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _evals(folder):
    import json

    log = json.loads((folder / "log.json").read_text())
    return log["losses"], {e["step"]: (e["train_loss"], e["val_loss"]) for e in log["evals"]}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from helpers import text_corpus

    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text_corpus(300))
    return path


def test_train_gpt_under_mpiexec_equals_one_process_and_resumes_with_another_w(corpus_file, tmp_path):
    """``mpiexec -n 2 python -m qkv train gpt --parallel context`` to step 4, then ``mpiexec -n 3
    ... --resume`` (data parallel, the default under mpiexec) to step 8: the log's losses and
    evaluations are one process's (float64, 1e-10); rank 0 alone printed."""
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    import contextlib
    import io

    from qkv.cli import main

    data = ["train", "gpt", "--data", str(corpus_file), *TINY]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*data, "--steps", "8", "--out", str(tmp_path / "one")]) == 0
    first = mpiexec(2, "-m", "qkv", *data, "--steps", "4", "--out", str(tmp_path / "w"), "--parallel", "context",
                    timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("training 4 steps") == 1 and "(context parallel over 2 ranks)" in first.stdout
    second = mpiexec(3, "-m", "qkv", *data, "--steps", "8", "--out", str(tmp_path / "w"), "--resume", timeout=60)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming at step 4 of 8 steps" in second.stdout and "(data parallel over 3 ranks)" in second.stdout
    (want, want_evals), (got, got_evals) = _evals(tmp_path / "one"), _evals(tmp_path / "w")
    assert len(got) == 8 and np.max(np.abs(np.subtract(got, want))) < 1e-10
    assert set(got_evals) == {0, 3, 4, 6, 8}
    for step, losses in got_evals.items():
        if step in want_evals:
            assert np.max(np.abs(np.subtract(losses, want_evals[step]))) < 1e-10, step


def test_train_gpt_under_mpiexec_refuses_a_batch_the_ranks_cannot_split(corpus_file, tmp_path):
    res = mpiexec(2, "-m", "qkv", "train", "gpt", "--data", str(corpus_file), *TINY, "--batch-size", "5",
                  "--steps", "2", "--out", str(tmp_path / "w"), timeout=60)
    assert res.returncode != 0, res.stdout + res.stderr   # MPI_Abort(1) on every rank
    assert ("qkv train gpt: error: parallelize (rank 0 of 2): batch_size = 5 must be a multiple of the W = 2 "
            "ranks") in res.stderr
    assert not (tmp_path / "w" / "config.json").exists()


def test_train_gpt_under_mpiexec_ends_when_one_rank_fails(corpus_file, tmp_path):
    """qkv's own entry (no ``-m mpi4py``): rank 1 raises at step 2 while rank 0 waits in the
    Allreduce; the job ends with a non-zero status instead of hanging."""
    res = mpiexec(2, "-c", FAIL_AT_STEP_2, "train", "gpt", "--data", str(corpus_file), *TINY, "--steps", "6",
                  "--out", str(tmp_path / "w"), timeout=60)
    assert res.returncode != 0 and "rank 1 fails at step 2" in res.stderr, res.stdout + res.stderr


def test_two_ranks_run_the_quick_train_mpi_suite_and_rank_0_reports(tmp_path):
    import json

    out = tmp_path / "bench.json"
    res = mpiexec(2, "-m", "qkv", "bench", "--suite", "train-mpi", "--quick", "--no-torch", "--json", str(out),
                  timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("GPT training over MPI") == 1
    rows = json.loads(out.read_text())["train_mpi"]
    assert [(r["mode"], r["W"], r["T"]) for r in rows] == [("data", 2, 48), ("context", 2, 48)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["single_tokens_per_s"] > 0 and len(r["peak_mib"]) == 2
        assert r["grad_bytes"] == 4 * r["params"] and r["sent_bytes"] >= r["grad_bytes"] / 2
    assert rows[0]["ring_s"] is None and rows[1]["ring_s"] >= 0 and rows[1]["sent_bytes"] > rows[0]["sent_bytes"]
