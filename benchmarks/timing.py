"""The one timing loop of the suite: callables timed in alternation, medians reported.

Every suite (attention, decoding, the encoder, the torch suite) times its sides with
:func:`rounds` (or :func:`alternate`, its medians): one untimed warm-up each, then
``repeats`` rounds in which every side runs once, so a change in machine load falls on all
sides alike. Each timed run records the wall-clock
time and the process's CPU time (all threads: on a shared machine it says how much work a
side did even when other jobs stretch the wall clock).

A side whose warm-up took under ``rewarm_below`` seconds is also run untimed right before
each of its timed runs, again and again for at least ``SETTLE_S`` seconds of its own work:
without it a short call pays for what ran before it (OpenBLAS's and torch's OpenMP worker
threads keep spinning after their work and steal a core, and a core left idle comes back
slowly); both distort a 30 ms decode. One untimed call was not enough below a millisecond:
torch's OpenMP workers (GOMP's default wait policy) still spun through it and the timed
call (qkv at (1, 8, 256, 16) forward: 0.77 ms after torch's call, 0.49 ms with
``OMP_WAIT_POLICY=PASSIVE``, 2 threads, AVX-512); 20 ms of the side's own calls first
measures each side in its own steady state, as a training or serving loop runs it.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

REWARM_S = 1.0
SETTLE_S = 0.02


def rounds(fns: dict[str, Callable[[], object]], repeats: int, *, rewarm_below: float = REWARM_S,
           rotate: bool = False, tick: Callable[[], None] | None = None,
           cpu_clock: Callable[[], float] = time.process_time,
           returns: dict[str, list] | None = None) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(wall s, cpu s), ...]}``, one pair per round: the runs themselves.

    One untimed warm-up each, then ``repeats`` rounds in which every side runs once, in the
    order given or, with ``rotate``, starting one side later each round (so no side always
    runs right after the same other one). ``tick()`` is called after every warm-up and every
    timed run (a progress count: ``len(fns) * (1 + repeats)`` calls in all). ``cpu_clock``:
    the CPU clock of the second number (``time.thread_time`` counts the calling thread alone:
    with every library held to one thread, a side's whole work and nothing else's). ``returns``:
    where given, ``returns[name]`` gets what each timed run returned, in the order of the runs (a
    side that clocks part of its own work reports that part of the very run the wall clock timed).
    """
    tick = tick or (lambda: None)
    rewarm = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        rewarm[name] = time.perf_counter() - t0 < rewarm_below
        tick()
    names = list(fns)
    runs = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            if rewarm[name]:
                s0 = time.perf_counter()
                fns[name]()
                while time.perf_counter() - s0 < SETTLE_S:
                    fns[name]()
            w0, c0 = time.perf_counter(), cpu_clock()
            got = fns[name]()
            runs[name].append((time.perf_counter() - w0, cpu_clock() - c0))
            if returns is not None:
                returns.setdefault(name, []).append(got)
            tick()
    return runs


def alternate(fns: dict[str, Callable[[], object]], repeats: int, *, rewarm_below: float = REWARM_S,
              tick: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """``{name: {"wall": s, "cpu": s}}``: medians over the :func:`rounds` (order as given)."""
    runs = rounds(fns, repeats, rewarm_below=rewarm_below, tick=tick)
    return {name: {"wall": statistics.median(w for w, _ in r), "cpu": statistics.median(c for _, c in r)}
            for name, r in runs.items()}


def walls(medians: dict[str, dict[str, float]]) -> dict[str, float]:
    """``{name: wall seconds}`` of :func:`alternate`'s result (what the attention tables show)."""
    return {name: m["wall"] for name, m in medians.items()}
