"""How long the README's commands take, recorded: ``docs/bench/times.json``, never typed by hand.

Each entry is one command run once on this project's 2-core machine, under a label that says
how loaded the machine was (``quiet``: nothing else running; ``loaded``: other work on both
cores), with its wall and CPU seconds, the load average sampled every 2 s while it ran, the CPU
and the date. The README's "How long things take" quotes these (a test holds the two together).

Usage, from the repository root::

    python docs/times.py record NAME LABEL -- COMMAND...      # run COMMAND (through bash), store it
    python docs/times.py show                                 # the records as the README's rows

NAME is what was timed (``first-command``, ``explain``, ``quick-try``, ``suite``), LABEL
``quiet`` or ``loaded``.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

TIMES = Path(__file__).resolve().parent / "bench" / "times.json"
LABELS = ("quiet", "loaded")


def cpu() -> str:
    """The CPU's model name and vector class (AVX-512 or AVX2), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    family = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cpu family")), "?")
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model\t")), "?")
    vectors = "AVX-512" if " avx512f" in info else "AVX2"
    return f"{name} (family {family} model {model}, {vectors}), {os.cpu_count()} cores"


def run(command: str) -> dict:
    """Run ``command`` through bash; its wall and CPU seconds and the load average while it ran."""
    samples, done = [os.getloadavg()[0]], threading.Event()

    def sample():
        while not done.wait(2.0):
            samples.append(os.getloadavg()[0])
    ticker = threading.Thread(target=sample, daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    ticker.start()
    try:
        proc = subprocess.run(["bash", "-c", command])
    finally:
        done.set()
        ticker.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"the command failed (exit {proc.returncode}); nothing recorded")
    return {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime
                                                    - before.ru_stime, 1),
            "load": {"mean": round(sum(samples) / len(samples), 2), "max": round(max(samples), 2)}}


def record(name: str, label: str, command: str, path: Path = TIMES) -> dict:
    if label not in LABELS:
        raise SystemExit(f"LABEL must be one of {LABELS}; got {label!r}")
    entry = {"command": command, **run(command), "cpu": cpu(),
             "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    times = json.loads(path.read_text()) if path.is_file() else {}
    times.setdefault(name, {})[label] = entry
    path.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    return entry


def said(entry: dict) -> str:
    """An entry as the README says it: ``72 s (48 s of CPU) at a load of 2.3``."""
    return f"{entry['wall_s']:.0f} s ({entry['cpu_s']:.0f} s of CPU) at a load of {entry['load']['mean']:.1f}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"] and len(argv) >= 5 and argv[3] == "--":
        entry = record(argv[1], argv[2], shlex.join(argv[4:]) if len(argv) > 5 else argv[4])
        print(f"{argv[1]} ({argv[2]}): {said(entry)}")
        return 0
    if argv[:1] == ["show"]:
        for name, labels in json.loads(TIMES.read_text()).items():
            for label, entry in labels.items():
                print(f"{name} {label}: {said(entry)}; {entry['cpu']}, {entry['recorded']}")
        return 0
    print(__doc__.split("Usage, from the repository root::")[1].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
