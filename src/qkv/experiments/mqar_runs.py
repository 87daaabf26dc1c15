"""The runs of ``qkv experiment mqar``: the learning-rate sweep, the seeds, and where each run goes.

Two phases, each a list of runs ``(mixer, width, lr, seed)``:

1. **the sweep**: every (mixer, width) at every lr of ``cfg.lrs``, seed ``cfg.seeds[0]``;
   :func:`choose` keeps, for each (mixer, width), the lr of the best *validation* accuracy
   (ties: fewer steps, then the smaller lr). The test set is never looked at to choose.
2. **the seeds**: the chosen lr again for every other seed of ``cfg.seeds``.

A run is made and fed from its seed alone and runs on one thread, so its result is the same
bits wherever it runs: in this process, in one of ``cfg.workers`` processes, or on any rank of
an MPI job (``mpiexec -n N qkv experiment mqar ...``, ranks on one host or several). With MPI,
rank r takes the runs ``r, r + N, r + 2N, ...`` of each phase, each run on one rank (with
``workers`` processes of its own), and the results are gathered to every rank after the sweep
(each rank then knows the chosen lrs) and to rank 0 after the seeds; rank 0 returns the
record, the other ranks ``None``.

**A run is never lost** (:class:`Kept`): without MPI, each finished run is appended to
``mqar.runs.jsonl`` in the output folder as it ends (a line a run, flushed to disk), under a
key of everything in the config a result depends on (not ``workers``), with the qkv version
and a checksum. The same command after an interruption reads the lines of that key and
version back and trains only the runs that are missing, or whose line is damaged or
implausible (skipped, and counted on stderr); the record is the same bits as an uninterrupted
run's (every run is made from its seed alone). The file is only appended to, and removed once
``mqar.json`` is written. Under MPI every rank trains its share again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .mqar import MQARConfig, train_one


def machine() -> str:
    """This machine in words: the CPU's model name (``/proc/cpuinfo``), cores, and AVX-512 or not."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {'AVX-512' if 'avx512f' in flags else 'no AVX-512'}"


KEPT = "mqar.runs.jsonl"
CHECKSUM = "sha256"


def config_key(cfg: MQARConfig) -> str:
    """A hash of every setting a run's result depends on (the config less ``workers``)."""
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items() if k != "workers"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _canonical(record: dict) -> str:
    """One record as the JSON its checksum is taken of: sorted keys, no spaces, one line."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _real(x) -> bool:
    """A finite float: what train_one writes for its accuracies, losses and seconds."""
    return isinstance(x, float) and math.isfinite(x)


def _fraction(x) -> bool:
    return _real(x) and 0 <= x <= 1


def _int_in(x, low: int, high: float) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _flaw(cfg: MQARConfig, run, r) -> str | None:
    """What makes ``run`` and its result ``r`` implausible for ``cfg`` (not what
    :func:`~qkv.experiments.mqar.train_one` returns for a run of its grid); None for a good one."""
    if not (isinstance(run, list) and len(run) == 4 and isinstance(run[0], str) and run[0] in cfg.mixers
            and _int_in(run[1], 1, math.inf) and run[1] in cfg.widths and isinstance(run[2], float)
            and run[2] in cfg.lrs and _int_in(run[3], 0, math.inf) and run[3] in cfg.seeds):
        return "run not one of this grid's (mixer, width, lr, seed)"
    if not isinstance(r, dict):
        return "result not a dict"
    missing = sorted({"accuracy", "val_accuracy", "diverged", "diverged_at", "final_loss", "seconds", "params",
                      "steps"} - set(r))
    if missing:
        return f"result missing {', '.join(missing)}"
    if not (isinstance(r["accuracy"], list) and len(r["accuracy"]) == len(cfg.pairs)
            and all(_fraction(a) for a in r["accuracy"])):
        return f"accuracy not {len(cfg.pairs)} float(s) in [0, 1]"
    if not _fraction(r["val_accuracy"]):
        return "val_accuracy not a float in [0, 1]"
    if not (isinstance(r["diverged"], bool) and (r["diverged_at"] is None) != r["diverged"]
            and (r["diverged_at"] is None or isinstance(r["diverged_at"], str))):
        return "diverged not a bool with its diverged_at"
    if not _int_in(r["steps"], 0, cfg.steps):
        return f"steps not a whole number in [0, {cfg.steps}]"
    if not (_real(r["final_loss"]) or (r["steps"] == 0 and isinstance(r["final_loss"], float))):
        return "final_loss not a finite float (NaN only before a first step)"
    if not (_real(r["seconds"]) and r["seconds"] >= 0):
        return "seconds not a finite float >= 0"
    if not _int_in(r["params"], 1, 2**63 - 1):
        return "params not a whole number in [1, 2**63)"
    return None


class Kept:
    """The runs of one config finished so far, kept in ``path``: ``done`` maps ``(mixer, width, lr,
    seed)`` to its result; :meth:`add` appends one line and syncs it to disk; nothing is ever
    rewritten in place.

    A line is the JSON ``{"key", "qkv", "run", "result", "sha256"}``: the config's key
    (:func:`config_key`), the qkv version that trained it, the run, the result of
    :func:`~qkv.experiments.mqar.train_one` and the SHA-256 of the line's canonical JSON without
    ``sha256``. A line of another config is passed over; a line that is not JSON (one a kill cut
    short), whose checksum is wrong, of another qkv version, or whose run or result is not
    plausible (an accuracy not a float in [0, 1], a field missing or of the wrong type, ...) is
    skipped, so its run is trained again, and the skipped lines are counted in ``skipped``
    (``{why: lines}``) and said in one line on stderr."""

    def __init__(self, path, cfg: MQARConfig):
        from .. import __version__

        self.path, self.key, self.version, self.done, self.skipped = Path(path), config_key(cfg), __version__, {}, {}
        if self.path.is_file():
            for line in self.path.read_bytes().split(b"\n"):
                if line.strip():
                    self._read(cfg, line)
        if self.skipped:
            why = "; ".join(f"{n} {reason}" for reason, n in self.skipped.items())
            print(f"qkv experiment mqar: {sum(self.skipped.values())} line(s) of {self.path} skipped, their runs "
                  f"trained again: {why}", file=sys.stderr, flush=True)

    def _read(self, cfg: MQARConfig, line: bytes) -> None:
        try:
            kept = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):        # bad UTF-8 or JSON (a line cut short), too deep
            return self._skip("not JSON (cut short or damaged)")
        if not isinstance(kept, dict) or not isinstance(kept.get(CHECKSUM), str):
            return self._skip("without a checksum")
        record = {k: v for k, v in kept.items() if k != CHECKSUM}
        try:
            good = hashlib.sha256(_canonical(record).encode()).hexdigest() == kept[CHECKSUM]
        except (ValueError, RecursionError):        # nesting json.loads took but json.dumps does not
            good = False
        if not good:
            return self._skip("with a wrong checksum")
        if record.get("key") != self.key:
            return None                             # another config's run: not ours to judge
        if record.get("qkv") != self.version:
            return self._skip(f"of another qkv version than {self.version}")
        flaw = _flaw(cfg, record.get("run"), record.get("result"))
        if flaw:
            return self._skip(flaw)
        m, w, lr, seed = record["run"]
        self.done.setdefault((m, w, float(lr), seed), record["result"])

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, run: tuple, result: dict) -> None:
        """Append ``run`` and its ``result`` as one line, on a line of its own (a last line a kill
        cut short is ended first, so that it alone is lost), and sync it to disk."""
        m, w, lr, seed = run
        record = {"key": self.key, "qkv": self.version, "run": [str(m), int(w), float(lr), int(seed)],
                  "result": result}
        line = _canonical({**record, CHECKSUM: hashlib.sha256(_canonical(record).encode()).hexdigest()}) + "\n"
        with open(self.path, "a+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())                  # "a": at the end whatever was read
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _job(args: tuple) -> tuple:
    cfg, run = args
    return run, train_one(cfg, *run)


def run_all(cfg: MQARConfig, runs: list, progress=None, comm=None, kept: Kept | None = None) -> dict:
    """``{run: result}`` of :func:`~qkv.experiments.mqar.train_one` for each ``(mixer, width, lr,
    seed)`` of ``runs``: this rank's share (every run without ``comm``) in ``cfg.workers``
    processes or this one, then, with ``comm``, every rank's results gathered to every rank.
    ``progress(run)`` is called as each run of this rank ends; ``kept``: the runs already done
    (taken as they are) and where each new one is added."""
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    results = {} if kept is None else {run: kept.done[run] for run in runs if run in kept.done}
    for run in results:
        if progress is not None:
            progress(run)
    mine = [run for run in runs[rank::size] if run not in results]

    def finished(run, result):
        results[run] = result
        if kept is not None:
            kept.add(run, result)
        if progress is not None:
            progress(run)
    if cfg.workers == 1 or len(mine) <= 1:
        for run in mine:
            finished(run, train_one(cfg, *run))
    else:
        import multiprocessing

        from ..heap import keep_freed_memory

        ctx = multiprocessing.get_context("spawn")  # no inherited thread pools or locks
        with ctx.Pool(min(cfg.workers, len(mine)), initializer=keep_freed_memory) as pool:
            for run, r in pool.imap_unordered(_job, [(cfg, run) for run in mine]):
                finished(run, r)
    if comm is not None and size > 1:
        for part in comm.allgather(results):
            results.update(part)
    return results


def choose(cfg: MQARConfig, sweep: dict) -> dict:
    """``{(mixer, width): lr}``: the lr of the best validation accuracy (then fewer steps, then the
    smaller lr; a diverged run loses to any that did not)."""
    best = {}
    for (m, w, lr, _), r in sweep.items():
        key = (not r["diverged"], r["val_accuracy"], -r["steps"], -lr)
        if (m, w) not in best or key > best[(m, w)][0]:
            best[(m, w)] = (key, lr)
    return {mw: lr for mw, (_, lr) in best.items()}


def mqar_experiment(cfg: MQARConfig | None = None, progress=None, comm=None, kept: Kept | None = None) -> dict | None:
    """Sweep, choose, train the seeds; returns the record written as ``mqar.json`` (on rank 0;
    ``None`` on the other ranks).

    ``rows``: one ``{mixer, width, pairs, accuracy, lr, seed, steps, val_accuracy, chosen}`` per
    run and pair count (``chosen``: the run is of its (mixer, width)'s chosen lr; the sweep's
    other runs are kept, marked False); ``runs``: one ``{mixer, width, lr, seed, steps,
    val_accuracy, final_loss, seconds, params, diverged, chosen}`` per run; ``chosen_lr``
    (``"mixer@width": lr``); ``chance`` (1 / values); ``tasks``; ``machine``; ``ranks``;
    ``seconds`` (wall); ``config``. ``progress(done, total)`` after each run of this rank.
    ``kept``: the runs of an interrupted call taken as they are, and every new one added (no MPI).
    """
    cfg = cfg or MQARConfig()
    cfg.check()
    done, total = 0, cfg.runs()

    def step(_run):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    start = time.perf_counter()
    models = [(m, int(w)) for m in cfg.mixers for w in cfg.widths]
    seed0, others = cfg.seeds[0], cfg.seeds[1:]
    sweep = run_all(cfg, [(m, w, float(lr), int(seed0)) for m, w in models for lr in cfg.lrs], step, comm, kept)
    chosen = choose(cfg, sweep)
    seeds = run_all(cfg, [(m, w, chosen[(m, w)], int(s)) for m, w in models for s in others], step, comm, kept)
    if comm is not None and comm.Get_rank() != 0:
        return None
    results = {**sweep, **seeds}
    rows, runs = [], []
    for m, w in models:
        order = [(m, w, float(lr), int(seed0)) for lr in cfg.lrs] + [(m, w, chosen[(m, w)], int(s)) for s in others]
        for run in order:
            r, pick = results[run], run[2] == chosen[(m, w)]
            lr, seed = run[2], run[3]
            rows += [{"mixer": m, "width": w, "pairs": int(p), "accuracy": a, "lr": lr, "seed": seed,
                      "steps": r["steps"], "val_accuracy": r["val_accuracy"], "chosen": pick}
                     for p, a in zip(cfg.pairs, r["accuracy"])]
            runs.append({"mixer": m, "width": w, "lr": lr, "seed": seed, "chosen": pick,
                         **{k: r.get(k) for k in ("steps", "val_accuracy", "final_loss", "seconds", "params", "diverged",
                                                   "diverged_at")}})
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    return {"rows": rows, "runs": runs, "chosen_lr": {f"{m}@{w}": lr for (m, w), lr in chosen.items()},
            "chance": 1.0 / (cfg.vocab_size - cfg.vocab_size // 2), "tasks": [list(t) for t in cfg.tasks()],
            "machine": machine(), "ranks": 1 if comm is None else comm.Get_size(),
            "seconds": round(time.perf_counter() - start, 1), "config": config}
