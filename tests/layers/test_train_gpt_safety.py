"""A training run is never destroyed: `qkv train gpt` as a user runs it, when things go wrong.

A diverging run stops before it saves NaN; bad hyper-parameters, a dtype AdamW cannot train,
an --out that cannot be written and damaged run files are refused up front with errors that
name the flag or the file; Ctrl-C (once or twice, while training or while saving) leaves a
complete checkpoint and exits 130; a stopped and resumed float32 run equals one that was not,
process for process, with and without the compiled kernels.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qkv.errors import ShapeError

pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402
from helpers import text_corpus  # noqa: E402

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2", "--no-progress"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text_corpus(400))
    return path


def _train(corpus_file, out, *args) -> int:
    return main(["train", "gpt", "--data", str(corpus_file), "--out", str(out), *TINY, *args])


def _qkv(*args, env=None, **kw) -> subprocess.Popen:
    """The command as a user runs it: a fresh process."""
    return subprocess.Popen([sys.executable, "-m", "qkv", *map(str, args)], cwd=ROOT, env=env or os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# --- a diverging run ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # diverging: NumPy warns of its overflows
def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(corpus_file, tmp_path, capsys):
    """lr 100 with a checkpoint every step: the run ends with status 1 and a message naming the
    step, what went non-finite and the cure, and what the folder keeps is a run that loads,
    samples and resumes (before: NaN weights saved over it, refused by sample and --resume)."""
    from qkv.io.runfiles import load_run

    out = tmp_path / "run"
    assert _train(corpus_file, out, "--lr", "100", "--warmup", "3", "--eval-interval", "1", "--steps", "60") == 1
    err = capsys.readouterr().err
    assert "the run diverged at step " in err and "lower --lr" in err and "Traceback" not in err
    step = int(err.split("the run diverged at step ")[1].split(":")[0])
    assert 1 < step < 60
    assert f"keeps the checkpoint of step {step - 1}" in err
    run = load_run(out)
    assert run.step == step - 1 and all(np.isfinite(p).all() for p in run.model.params.values())
    assert all(np.isfinite(x) for x in run.log["losses"])
    assert main(["sample", str(out), "--tokens", "5"]) == 0


def test_a_non_finite_loss_or_gradient_stops_before_the_update(corpus_file, tmp_path):
    """train(): a NaN gradient at step 3 raises Diverged naming the step and the arrays, with
    the weights and AdamW's moments as step 2 left them, and the checkpoint of step 2 untouched."""
    from qkv.training.chardata import CharDataset
    from qkv.io.runfiles import save_run
    from qkv.training.loop import Diverged, TrainConfig, new_run, train

    text = corpus_file.read_text()
    cfg = TrainConfig(block_size=16, batch_size=4, n_layer=1, n_head=2, n_embd=16, eval_iters=2, warmup=2,
                      eval_interval=2, steps=6, lr=1e-2, dtype="float64")
    run = new_run(cfg, CharDataset(text), "play", text)
    backward = run.model.backward

    def poisoned():
        backward()
        if run.step == 2:
            run.model.grads["transformer.h.0.mlp.W_fc"][0, 0] = np.nan
    run.model.backward = poisoned
    kept = {}

    def checkpoint(r):
        save_run(r, tmp_path)
        kept.update({n: (tmp_path / n).read_bytes() for n in ("model.safetensors", "optim.safetensors")})
        kept["params"] = {n: p.copy() for n, p in r.model.params.items()}
    with pytest.raises(Diverged, match=r"at step 3: the gradients are not finite \(transformer.h.0.mlp.W_fc"):
        train(run, CharDataset(text), checkpoint=checkpoint)
    assert run.step == 2 and run.opt.t == 2
    for name, p in run.model.params.items():
        np.testing.assert_array_equal(p, kept["params"][name], err_msg=name)
    assert all((tmp_path / n).read_bytes() == kept[n] for n in ("model.safetensors", "optim.safetensors"))

    run.model.backward = backward
    run.model.loss = lambda x, y: float("inf")
    with pytest.raises(Diverged, match="at step 3: the batch loss is inf"):
        train(run, CharDataset(text))


# --- refused up front, named as typed ----------------------------------------------------------

@pytest.mark.parametrize("flags, said", [
    (["--lr", "inf"], "--lr must be a finite number in (0, inf); got inf"),
    (["--lr", "nan"], "--lr must be a finite number in (0, inf); got nan"),
    (["--min-lr", "nan"], "--min-lr must be a number in [0, --lr]"),
    (["--dropout", "nan"], "--dropout must be a finite number in [0, 1); got nan"),
    (["--steps", "0"], "--steps must be an int >= 1; got 0"),
    (["--n-embd", "30", "--n-head", "4"], "--n-embd must be a multiple of --n-head; got --n-embd 30, --n-head 4"),
    (["--lr-decay-steps", "0"], "--lr-decay-steps must be an int >= 1; got 0"),
])
def test_bad_hyperparameters_are_refused_by_their_flags_before_out_is_made(corpus_file, tmp_path, capsys,
                                                                            flags, said):
    out = tmp_path / "never"
    assert _train(corpus_file, out, *flags) == 2
    err = capsys.readouterr().err
    assert said in err and "lr_decay_steps" not in err and "n_embd" not in err
    assert not out.exists()


def test_the_optimizers_refuse_what_they_cannot_train():
    """float16 parameters (eps = 1e-8 is 0 there: one step made 18 of 20 arrays NaN) and
    non-finite hyper-parameters are refused when the optimizer is made."""
    from qkv.models import GPT, GPTConfig
    from qkv.training.loop import TrainConfig
    from qkv.nn import Adam, AdamW

    half = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype=np.float16))
    for opt in (AdamW, Adam):
        with pytest.raises(ShapeError, match=r"updates float32 or float64 parameters; transformer.wte.weight is "
                                             r"float16 .*train in float32"):
            opt([half])
    full = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    for kw, name in ((dict(lr=float("inf")), "lr"), (dict(eps=0.0), "eps"), (dict(betas=(0.9, 1.0)), "betas"),
                     (dict(weight_decay=float("nan")), "weight_decay"), (dict(clip=float("inf")), "clip")):
        with pytest.raises(ShapeError, match=rf"^{name}.* must be a finite number"):
            AdamW(full, **kw)
    with pytest.raises(ShapeError, match="lr must be a finite number"):
        AdamW(full).step(float("nan"))
    with pytest.raises(ShapeError, match="dtype must be one of float32, float64"):
        TrainConfig(dtype="float16").resolved()
    with pytest.raises(ShapeError, match="dtype must be float16, float32 or float64"):
        GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="bfloat16")


# --- what --resume reads -------------------------------------------------------------------------

@pytest.fixture
def small_run(corpus_file, tmp_path):
    out = tmp_path / "run"
    assert _train(corpus_file, out, "--steps", "2", "--eval-interval", "1") == 0
    return out


def _damage_config(out):
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["dtype"] = "float64"
    (out / "config.json").write_text(json.dumps(meta))


def _infinite_lr(out):
    meta = json.loads((out / "config.json").read_text())
    meta["extra"]["train"]["config"]["lr"] = float("inf")  # JSON's Infinity
    (out / "config.json").write_text(json.dumps(meta))


def _damage_log(out):
    (out / "log.json").write_text('{"evals": [')


def _truncate_optim(out):
    data = (out / "optim.safetensors").read_bytes()
    (out / "optim.safetensors").write_bytes(data[:len(data) // 2])


def _negative_rng_state(out):
    meta = json.loads((out / "config.json").read_text())
    meta["extra"]["train"]["rng"]["state"]["state"] = -5  # before: a raw OverflowError
    (out / "config.json").write_text(json.dumps(meta))


def _nan_in_optim(out):
    """NaN bytes in a moment of optim.safetensors (before: resumed, then reported as the run diverging)."""
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    path = str(out / "optim.safetensors")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    arrays = load_file(path)
    key = next(k for k in arrays if ".m/" in k or k.startswith("state.m/"))
    arrays[key].reshape(-1)[0] = np.nan
    save_file(arrays, path, metadata=meta)


@pytest.mark.parametrize("damage, said", [
    (_negative_rng_state, "config.json: the saved data stream's state is damaged: OverflowError"),
    (_nan_in_optim, "optim.safetensors: tensor "),
    (_damage_config, "config.json: the model's config disagrees with the run's training config: dtype 'float64' "
                     "(the training config makes 'float32')"),
    (_infinite_lr, "config.json: bad training state under extra.train: lr must be a finite number"),
    (_damage_log, "log.json"),
    (_truncate_optim, "optim.safetensors (damaged or truncated?)"),
])
def test_resume_names_the_file_it_cannot_use(small_run, capsys, damage, said):
    capsys.readouterr()
    damage(small_run)
    assert main(["train", "gpt", "--out", str(small_run), "--resume", "--steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and str(small_run) in err


def test_an_out_folder_that_cannot_be_written_is_refused_before_training(corpus_file, tmp_path, capsys):
    """An existing, read-only --out: refused before the first step, not at the first checkpoint
    with a raw OSError. As root, permission bits do not stop writes, so the folder is made
    read-only for real: a read-only bind mount in a private mount namespace (unshare -m)."""
    out = tmp_path / "ro"
    out.mkdir()
    args = ["train", "gpt", "--data", str(corpus_file), "--out", str(out), *TINY, "--steps", "2",
            "--eval-interval", "1"]
    if os.geteuid() != 0:
        out.chmod(0o555)
        try:
            assert main(args) == 2
        finally:
            out.chmod(0o755)
        err = capsys.readouterr().err
    else:
        if shutil.which("unshare") is None:
            pytest.skip("as root a read-only folder needs a read-only mount: unshare (util-linux) is not installed")
        cmd = (f"mount --bind {out} {out} && mount -o remount,bind,ro {out} && ! touch {out}/x 2>/dev/null "
               f"&& exec {sys.executable} -m qkv {' '.join(args)}")
        res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 2 and "mount" in res.stderr:
            pytest.skip(f"no read-only bind mount here (unshare -m needs CAP_SYS_ADMIN): {res.stderr.strip()}")
        assert res.returncode == 2, res.stderr
        err = res.stderr
    assert "--out must be a folder qkv can write to" in err and "Traceback" not in err
    assert "training" not in err and list(out.iterdir()) == []


# --- Ctrl-C ------------------------------------------------------------------------------------

# Runs the command with two hooks that make a test's Ctrl-C land at a known point: every save
# of the run waits (before writing) for the test's go-<n> file, after writing saving-<n>, and
# every Ctrl-C the command has handled writes pressed-<n>.
DRIVER = """
import sys, time, pathlib
from qkv.cli import main
from qkv.io import runfiles
from qkv.training.interrupt import CtrlC
marks, real_save, real_handler, n = pathlib.Path(sys.argv[1]), runfiles.save_run, CtrlC.handler, [0]
def save_run(run, folder):
    n[0] += 1
    (marks / f"saving-{n[0]}").touch()
    while not (marks / f"go-{n[0]}").exists():
        time.sleep(0.01)
    real_save(run, folder)
def handler(self, signum, frame):
    try:
        real_handler(self, signum, frame)
    finally:
        (marks / f"pressed-{self.presses}").touch()
runfiles.save_run, CtrlC.handler = save_run, handler
sys.exit(main(sys.argv[2:]))
"""


def _terminal_sigint() -> None:
    """In the child before it starts: SIGINT as a terminal gives it. A suite started in the
    background (``pytest &``) hands its children SIGINT ignored, and Python then installs no
    handler that a Ctrl-C could reach."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path.name} never came"
        time.sleep(0.01)


def _driven(corpus_file, tmp_path, out):
    marks = tmp_path / "marks"
    marks.mkdir()
    args = ["train", "gpt", "--data", corpus_file, "--out", out, *TINY, "--steps", "50", "--eval-interval", "2"]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, marks, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_sigint)
    return proc, marks


def _press(proc, marks, n):
    proc.send_signal(signal.SIGINT)
    _wait(marks / f"pressed-{n}", proc)


def test_ctrl_c_then_ctrl_c_again_while_saving_leaves_a_complete_run_and_exits_130(corpus_file, tmp_path):
    """The first Ctrl-C (during the checkpoint of step 2) stops the run after step 3; the second,
    during that last save, waits for it: the files are step 3's, loss.png is drawn, no
    traceback, status 130 (before: a 40-line traceback, no loss.png, status 0 when once)."""
    from qkv.io.runfiles import load_run

    out = tmp_path / "run"
    proc, marks = _driven(corpus_file, tmp_path, out)
    _wait(marks / "saving-1", proc)
    _press(proc, marks, 1)
    (marks / "go-1").touch()
    _wait(marks / "saving-2", proc)
    _press(proc, marks, 2)
    (marks / "go-2").touch()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "stopped at step 3 of 50" in stdout
    run = load_run(out)
    assert run.step == 3 and len(run.log["losses"]) == 3
    try:
        import matplotlib  # noqa: F401
        assert (out / "loss.png").stat().st_size > 1000
    except ImportError:
        pass
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_two_ctrl_c_during_a_save_abort_once_it_is_complete(corpus_file, tmp_path):
    from qkv.io.runfiles import load_run

    out = tmp_path / "run"
    proc, marks = _driven(corpus_file, tmp_path, out)
    _wait(marks / "saving-1", proc)
    _press(proc, marks, 1)
    _press(proc, marks, 2)
    (marks / "go-1").touch()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "aborted at step 2 of 50" in stderr
    assert f"{out} keeps the checkpoint of step 2" in stderr
    assert load_run(out).step == 2 and not (marks / "saving-2").exists()


def test_bench_on_ctrl_c_says_so_and_exits_130(tmp_path):
    """The suite replaced by one that waits: the Ctrl-C lands while it measures."""
    pytest.importorskip("rich", reason="qkv bench needs the cli extra (rich)")
    driver = ("import sys, time, pathlib\n"
              "from qkv.cli import main\nimport qkv_benchmarks.suites as s\n"
              "def waiting(*a, **k):\n    pathlib.Path(sys.argv[1]).touch()\n    time.sleep(120)\n"
              "s.run_suites = waiting\nsys.exit(main(['bench', '--quick', '--suite', 'gpt']))\n")
    ready = tmp_path / "measuring"
    proc = subprocess.Popen([sys.executable, "-c", driver, ready], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_sigint)
    _wait(ready, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "qkv bench: interrupted (Ctrl-C)" in stderr and "Traceback" not in stderr


# --- sampling ------------------------------------------------------------------------------------

def test_a_tiny_temperature_samples_the_greedy_tokens():
    """logits / 5e-324 overflowed to inf - inf = NaN and drew token 0; now the limit: greedy."""
    from qkv.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=13, block_size=16, n_layer=1, n_head=2, n_embd=16, seed=3))
    prompt = np.array([[1, 5, 7]])
    greedy = model.generate(prompt, 6, temperature=0)
    for t in (5e-324, 1e-300, 1e-30):
        np.testing.assert_array_equal(model.generate(prompt, 6, temperature=t, rng=np.random.default_rng(0)), greedy)
        np.testing.assert_array_equal(model.generate(prompt, 6, temperature=t, top_k=4,
                                                     rng=np.random.default_rng(0)), greedy)
    assert greedy[0, 3:].any()  # not all token 0
    with pytest.raises(ShapeError, match="temperature must be a finite number >= 0; got inf"):
        model.generate(prompt, 2, temperature=float("inf"))


# --- the same bits, stopped or not -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("jit", ["1", "0"], ids=["compiled", "numpy-only"])
def test_a_float32_run_resumed_in_another_process_equals_one_that_was_not(corpus_file, tmp_path, jit):
    """float32, 6 steps in one process against 3 steps and --resume to 6 in two others: every
    loss, the weights and AdamW's moments bit for bit (the module's promise), with the compiled
    kernels and without (QKV_JIT=0)."""
    from qkv.io.runfiles import load_state

    env = dict(os.environ, QKV_JIT=jit)
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*TINY, "--eval-interval", "3", "--lr", "1e-2"]
    runs = [_qkv("train", "gpt", "--data", corpus_file, "--out", a, "--steps", "6", *common, env=env),
            _qkv("train", "gpt", "--data", corpus_file, "--out", b, "--steps", "3", "--lr-decay-steps", "6",
                 *common, env=env)]
    for proc in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    proc = _qkv("train", "gpt", "--out", b, "--resume", "--steps", "6", "--no-progress", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    la, lb = (json.loads((d / "log.json").read_text()) for d in (a, b))
    assert la["losses"] == lb["losses"] and len(la["losses"]) == 6
    assert [e["val_loss"] for e in la["evals"]] == [e["val_loss"] for e in lb["evals"]]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    sa, sb = load_state(a / "optim.safetensors"), load_state(b / "optim.safetensors")
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
