"""Run under ``mpiexec -n W python -m mpi4py tests/distributed/mpi_train_cases.py DIR [fail]``; driven by
test_parallel_train.py. Every rank trains a tiny GPT on one process (the reference, the same
on every rank) and on all W ranks together (data and context parallel), and compares the
losses, evaluations and weights; then a checkpoint written by W ranks resumes on one process
and one written by one process resumes on W ranks. Prints ``rank R ok NAME max-diff X`` per
case; a mismatch raises, which under ``-m mpi4py`` ends the job with a non-zero status.

``fail``: every rank checks a batch that W ranks cannot split, then runs whose configs differ
(the same ShapeError on all, each time), then rank W-1 alone raises in the middle of training while the others wait in the
gradients' Allreduce: the job must end, not hang."""
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from qkv.distributed.train import ParallelGPT, parallelize
from qkv.models import GPT, GPTConfig
from qkv.training.chardata import CharDataset
from qkv.io.runfiles import load_run, save_run
from qkv.training.loop import TrainConfig, new_run, train

comm = MPI.COMM_WORLD
W, r = comm.Get_size(), comm.Get_rank()
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
TEXT = " ".join(np.random.default_rng(0).choice(WORDS, 400)) + "\n"
DATA = CharDataset(TEXT)
TOL = 1e-10


def say(line):
    os.write(1, (line + "\n").encode())   # one write: the ranks' lines do not interleave


def config(**kw):
    """Block 12 splits into 2W chunks for W = 1, 2, 3; the global batch is 2 rows a rank."""
    base = dict(block_size=12, batch_size=2 * W, n_layer=2, n_head=2, n_embd=8, steps=20, warmup=3,
                eval_interval=10, eval_iters=2, dtype="float64", lr=1e-2)
    return TrainConfig(**dict(base, **kw))


def fresh(cfg):
    return new_run(cfg, DATA, "words", TEXT)


def diff(a, b) -> float:
    """The largest difference of the losses, the evaluations and the weights of two runs."""
    out = float(np.max(np.abs(np.subtract(a.log["losses"], b.log["losses"]))))
    for ea, eb in zip(a.log["evals"], b.log["evals"], strict=True):
        out = max(out, abs(ea["train_loss"] - eb["train_loss"]), abs(ea["val_loss"] - eb["val_loss"]))
    pa, pb = a.model.params, b.model.params
    return max(out, max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa))


def check(name, got, tol):
    say(f"rank {r} ok {name} max-diff {got:.3g}")
    if not got <= tol:
        raise AssertionError(f"{name}: {got} > {tol}")


def reference(cfg):
    run = fresh(cfg)
    train(run, DATA)
    return run


def equal_training():
    ref = reference(config())
    for mode in ("data", "context"):
        run = parallelize(fresh(config()), mode)
        train(run, DATA)
        check(f"{mode}-float64-20-steps", diff(run, ref), TOL)
    ref32 = reference(config(dtype="float32"))
    for mode in ("data", "context"):
        run = parallelize(fresh(config(dtype="float32")), mode)
        train(run, DATA)
        check(f"{mode}-float32-20-steps", diff(run, ref32), 1e-5)   # the sums' order differs
    return ref


def equal_context_gradients():
    """RoPE and GQA, one step's loss and every gradient (the ring layers at global positions)."""
    cfg = GPTConfig(vocab_size=DATA.tokenizer.vocab_size, block_size=24, n_layer=2, n_head=4, n_kv_head=2,
                    n_embd=16, positions="rope", dtype=np.float64, seed=3)
    x, y = DATA.batch("train", 3, 24, np.random.default_rng(5))
    one = GPT(cfg)
    want = one.loss(x, y)
    one.backward()
    par = ParallelGPT(GPT(cfg), "context")
    got = par.loss(x, y)
    par.backward()
    check("context-rope-gqa-grads", max(abs(got - want), max(float(np.max(np.abs(par.grads[k] - g)))
                                                              for k, g in one.grads.items())), TOL)


def resume_with_another_w(ref, folder: Path):
    """W ranks to step 10, saved by rank 0, then one process to 20; and one process to 10,
    then W ranks (context parallel) to 20: both equal the reference's 20 steps."""
    run = parallelize(fresh(config(steps=10, lr_decay_steps=20)), "data")
    train(run, DATA, checkpoint=lambda run_: save_run(run_, folder / f"w{W}") if r == 0 else None)
    comm.Barrier()
    if r == 0:
        one = load_run(folder / f"w{W}")
        one.cfg.steps = 20
        train(one, DATA)
        check("saved-by-W-resumed-by-1", diff(one, ref), TOL)
        single = fresh(config(steps=10, lr_decay_steps=20))
        train(single, DATA, checkpoint=lambda run_: save_run(run_, folder / "one"))
    comm.Barrier()
    run = parallelize(load_run(folder / "one"), "context")
    run.cfg.steps = 20
    train(run, DATA)
    check("saved-by-1-resumed-by-W", diff(run, ref), TOL)


def fail():
    for bad in (config(batch_size=2 * W + 1), config(lr=0.01 * (1 + r))):  # one no rank can split; ranks that differ
        try:
            parallelize(fresh(bad), "data")
        except Exception as err:
            say(f"rank {r} raised: {type(err).__name__}: {err}")
    run = parallelize(fresh(config()), "data")
    if r == W - 1:
        model_loss = run.model.model.loss

        def broken(x, y):
            if run.step == 3:
                raise RuntimeError(f"rank {r} fails at step 3")
            return model_loss(x, y)
        run.model.model.loss = broken
    train(run, DATA)
    say(f"rank {r} finished: it should not have")


if __name__ == "__main__":  # not on import (pytest's doctest collection imports every module)
    if "fail" in sys.argv[2:]:
        fail()
    else:
        reference_run = equal_training()
        equal_context_gradients()
        resume_with_another_w(reference_run, Path(sys.argv[1]))
