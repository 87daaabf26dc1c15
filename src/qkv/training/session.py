"""``qkv train gpt`` as one call: a run made or resumed, trained, checkpointed into its folder.

:func:`train_gpt` is the whole command after parsing, top to bottom::

    run, dataset = prepare(request)             a new run (settings, data, --init-from) or the one in out/
    if request.eval_only: evaluate, return      nothing written
    writable_folder(out)                        made only once the run is checked
    train(run, dataset, checkpoint=save)        qkv.training.loop; each checkpoint a whole save_run(run, out)
    plot_log(run.log, out/loss.png)             the run's end

What the caller shows is up to it: an :class:`Events` object gets the run once it starts, every
step and log entry, and is told when training ends (a progress bar closes there); the
:class:`Outcome` says how the run ended, which step the folder keeps and what was written. Ctrl-C
(:mod:`qkv.training.interrupt`) stops after the current step and saves; a second press aborts,
never in the middle of a save. Under MPI (``comm``) every rank calls this, rank 0 alone writes,
and a rank that cannot make the run stops every rank before the first step.

Errors of the request (a folder that holds a run already, settings ``--resume`` cannot change,
other data than the run's) are :class:`qkv.ShapeError` naming the command's flag (``names``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ShapeError
from .interrupt import CtrlC

__all__ = ["Events", "Outcome", "Request", "RESUMABLE", "prepare", "train_gpt"]

# What --resume may change: the rest is the run's model, optimizer or data stream.
RESUMABLE = {"steps", "eval_interval", "eval_iters", "lr_decay_steps", "keep_best"}
WRITTEN = ["model.safetensors", "config.json", "optim.safetensors", "log.json"]


@dataclass
class Request:
    """What a run is asked to be: ``given`` holds the :class:`~qkv.training.config.TrainConfig`
    fields set (the rest are the defaults, or the resumed run's); ``names`` maps a field to the
    flag errors name (``{"lr": "--lr"}``)."""

    out: Path
    given: dict = field(default_factory=dict)
    data: str | None = None                 # a text file, nanoGPT's data folder, None: Shakespeare
    tokenizer: str | None = None            # char, gpt2, a folder or tokenizer.json
    init_from: str | None = None            # gpt2, a hub id or a folder
    resume: bool = False
    eval_only: bool = False
    names: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """How a run ended: ``status`` is ``"done"``, ``"stopped"`` (Ctrl-C, saved), ``"diverged"``
    (``error`` says where; nothing of it saved), ``"aborted"`` (a second Ctrl-C) or
    ``"evaluated"`` (``eval_only``: ``evaluation`` holds the losses). ``saved`` is the step of the
    checkpoint the folder keeps (None: nothing saved); ``written`` the files of the last save."""

    run: object
    dataset: object
    status: str = "done"
    start: int = 0
    saved: int | None = None
    error: Exception | None = None
    evaluation: dict | None = None
    written: list = field(default_factory=list)
    not_drawn: str | None = None            # why loss.png was not drawn (matplotlib missing)


class Events:
    """What a caller sees of a run; every method does nothing unless overridden."""

    def started(self, run, dataset, note: str | None) -> None:
        """The run is about to train from ``run.step``; ``note``: what a resume's schedule does."""

    def progress(self, step: int, loss: float, val, rate: float) -> None:
        """After every step: its loss, the latest evaluation's val loss (None before one), tokens/s."""

    def logged(self, entry: dict) -> None:
        """Every step's ``{"step", "loss", "ms", "tokens_per_s"}`` and every evaluation's entry."""

    def finished(self) -> None:
        """Training ended (done, stopped, diverged or aborted), before anything else is said."""


def prepare(request: Request):
    """``(run, dataset)``: the run in ``request.out`` continued (``resume``) or a new one."""
    from ..io.runsave import finish_save

    # a save killed half way is completed (or discarded) before the folder is judged
    finish_save(request.out)
    return (_resumed if request.resume else _new)(request)


def _new(request: Request):
    from .config import TrainConfig
    from .loop import new_run
    from .memory import check_fits
    from .sources import new_data

    out, names = request.out, request.names
    if (out / "config.json").exists() and not request.eval_only:
        raise ShapeError(f"{out} already holds a run: continue it with --resume, or choose another --out")
    cfg = replace(TrainConfig(), **request.given).resolved(names)  # before reading (or fetching) the text
    check_fits(cfg, cfg.vocab_size or 1, names)  # what the sizes need whatever the vocabulary
    model = folder = None
    if request.init_from is not None:
        from .finetune import init_model

        cfg, model, folder = init_model(cfg, request.init_from, set(request.given), names)
    dataset, data = new_data(request.data, request.tokenizer, cfg.vocab_size, folder)
    return new_run(cfg, dataset, data["source"], data=data, model=model, names=names), dataset


def _resumed(request: Request):
    from ..io.runfiles import load_run
    from .loop import check_data
    from .memory import check_fits
    from .sources import resumed_data

    out, names, given = request.out, request.names, request.given
    if not (out / "config.json").exists():
        raise ShapeError(f"--resume: {out} holds no run (no config.json); start one without --resume")
    for flag, value in (("--init-from", request.init_from), ("--tokenizer", request.tokenizer)):
        if value is not None:
            raise ShapeError(f"--resume cannot take {flag}: the run in {out} keeps its weights and tokenizer")
    run = load_run(out)
    fixed = {k: v for k, v in given.items() if k not in RESUMABLE and v != getattr(run.cfg, k)}
    if fixed:
        said = ", ".join(f"{names.get(k, k)} {v} (the run has {getattr(run.cfg, k)})" for k, v in fixed.items())
        raise ShapeError(f"--resume cannot change the run's model, optimizer or data stream: {said}")
    run.cfg = replace(run.cfg, **{k: v for k, v in given.items() if k in RESUMABLE})
    run.cfg.check(names)
    if run.cfg.steps < run.step:
        raise ShapeError(f"--steps {run.cfg.steps}: the run in {out} is already at step {run.step}")
    check_fits(run.cfg, run.model.config.vocab_size, names)  # this machine may have less than the one it ran on
    dataset = resumed_data(request.data, run, out)
    check_data(run.cfg, dataset)
    return run, dataset


def train_gpt(request: Request, events: Events | None = None, *, comm=None, mode: str | None = None) -> Outcome:
    """Make or resume the run ``request`` asks for and train it to its ``steps``, saving into
    ``request.out`` at every evaluation; returns how it ended. With ``comm`` (an mpi4py
    communicator) and ``mode`` (``"data"`` or ``"context"``) every rank trains its share
    (:func:`qkv.distributed.train.parallelize`) and rank 0 alone writes and hears ``events``."""
    from ..io.runsave import writable_folder

    events = events or Events()
    if comm is None:
        run, dataset = prepare(request)
        if request.eval_only:
            from .loop import evaluate

            return Outcome(run, dataset, "evaluated", run.step, evaluation=evaluate(run.model, dataset, run.cfg))
        writable_folder(request.out)  # made (and tried) only once the run is checked: a refusal leaves nothing
        return _fit(request, run, dataset, events)
    if request.eval_only:
        raise ShapeError("--eval-only evaluates in one process; run it without mpiexec")
    from ..distributed.agree import agree
    from ..distributed.train import parallelize

    def make():
        made = prepare(request)
        if comm.Get_rank() == 0:
            writable_folder(request.out)  # rank 0 writes; a refusal there stops every rank before the first step
        return made
    signature = {"request": sorted((k, repr(v)) for k, v in vars(request).items())}
    run, dataset = agree(comm, "qkv train gpt", make, signature)
    return _fit(request, parallelize(run, mode or "data", comm=comm), dataset, events, comm)


def _fit(request: Request, run, dataset, events: Events, comm=None) -> Outcome:
    """Train ``run`` with a checkpoint at every evaluation; with ``comm`` rank 0 alone saves and
    hears ``events``."""
    from .loop import Diverged, train
    from .sources import schedule_note

    rank = 0 if comm is None else comm.Get_rank()
    outcome = Outcome(run, dataset, start=run.step, saved=run.step if request.resume else None)
    quiet = Events()
    shown = events if rank == 0 else quiet
    note = schedule_note(run, "lr_decay_steps" in request.given) if request.resume else None
    shown.started(run, dataset, note)
    with CtrlC.installed() as ctrl_c:
        checkpoint = (lambda r: _save(r, request.out, ctrl_c, outcome)) if rank == 0 else None
        stop = ctrl_c.pressed if comm is None else _agreed(comm, ctrl_c.pressed)
        try:
            try:
                outcome.status = train(run, dataset, checkpoint=checkpoint, stop=stop, progress=shown.progress,
                                       log=shown.logged)
            finally:
                shown.finished()
            if rank == 0:
                with ctrl_c.saving(last=True):
                    _finish(outcome, request.out)
        except Diverged as err:
            outcome.status, outcome.error = "diverged", err
        except KeyboardInterrupt:
            outcome.status = "aborted"
    return outcome


def _save(run, out: Path, ctrl_c: CtrlC, outcome: Outcome) -> None:
    """The checkpoint: the run's files written whole (a Ctrl-C waits), or the folder as it was."""
    from ..io import runfiles

    with ctrl_c.saving():
        try:
            runfiles.save_run(run, out)
        except OSError as err:
            kept = f"{out} keeps the checkpoint of step {outcome.saved}" if outcome.saved is not None \
                else f"Nothing was saved to {out}"
            raise ShapeError(f"cannot save step {run.step} into --out {str(out)!r}: {err}. {kept}") from None
        outcome.saved = run.step


def _finish(outcome: Outcome, out: Path) -> None:
    """The run's end: loss.png drawn, and the files the folder holds now named."""
    from .loop import plot_log

    run = outcome.run
    if run.step == outcome.start and outcome.saved == run.step:
        return  # a finished run resumed: nothing trained, nothing written
    outcome.written = list(WRITTEN)
    try:
        plot_log(run.log, out / "loss.png", f"qkv train gpt: {out.name}")
        outcome.written.append("loss.png")
    except ImportError as err:  # matplotlib missing: the run is saved, the picture is not
        outcome.not_drawn = str(err)
    if run.cfg.keep_best and outcome.saved != run.step:
        outcome.written = outcome.written[4:]


def _agreed(comm, pressed):
    """``stop()`` for every rank: True on all once Ctrl-C reached any (a collective per step)."""
    from mpi4py import MPI

    return lambda: comm.allreduce(pressed(), op=MPI.LOR)
