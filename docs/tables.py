"""The measured tables of the docs, made from the JSON that the commands wrote, never typed by hand.

A measurement lives in ``docs/bench/NAME.json``: what ``qkv bench --json`` wrote, plus the
command that produced it (``command``), when (``recorded``, UTC) and the machine's load
average before and after (``load``: a shared machine shows). A page asks for its tables with
a pair of marker comments; everything between them is this script's::

    <!-- bench: NAME -->
    (the command, the bench's header with its machine line, each table with its notes)
    <!-- /bench -->

Usage, from the repository root::

    python docs/tables.py                    # rewrite every marked block of docs/*.md
    python docs/tables.py --check            # exit 1 where a page differs from what its JSON gives
    python docs/tables.py record NAME -- qkv bench --suite shapes --repeats 3
                                             # run that command with --json, store docs/bench/NAME.json

The tables are ``qkv_benchmarks.report``'s, the same that ``qkv bench`` prints, as Markdown.

The experiments' records (``qkv experiment complexity|recall --out docs/`` writes
``docs/complexity.json``, ``docs/recall.json``) get the same treatment; their marker names
the command that wrote the file, and the table is the experiment's own ``format_table``::

    <!-- experiment: recall | qkv experiment recall --out docs/ -->
    <!-- /experiment -->
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
BENCH = DOCS / "bench"
BLOCK = re.compile(r"(<!-- (?P<kind>bench|experiment): (?P<name>[\w.-]+)(?: \| (?P<command>[^>]*?))? -->\n)"
                   r"(?P<body>.*?)(?P<end><!-- /(?P=kind) -->)", re.S)
# experiment name -> the module whose format_table(record) renders its JSON
EXPERIMENTS = {"complexity": "qkv.experiments.complexity_report", "recall": "qkv.experiments.recall",
               "mqar": "qkv.experiments.mqar_report", "mqar-v1": "qkv.experiments.mqar_report", "mqar-plain": "qkv.experiments.mqar_report",
               "mqar-w64": "qkv.experiments.mqar_report", "mqar-700": "qkv.experiments.mqar_report",
               "mqar-avx2": "qkv.experiments.mqar_report", "mqar-mamba2-4000": "qkv.experiments.mqar_report",
               "mqar-gpt": "qkv.experiments.mqar_report"}


def load(name: str, bench: Path = BENCH) -> dict:
    """The stored record ``bench/NAME.json``; a missing file or a record without its command
    is a ``ValueError`` naming the file."""
    path = bench / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"a page asks for bench record {name!r}, but {path} does not exist")
    record = json.loads(path.read_text())
    if not record.get("command"):
        raise ValueError(f"{path} has no 'command': record it with `python docs/tables.py record {name} -- ...`")
    return record


def render(record: dict, name: str | None = None) -> str:
    """The Markdown of one record (``bench/NAME.json``, linked when ``name`` is given): its command and when, the bench's header lines (machine
    included) in a text block, then each table under its title, its notes in a text block."""
    from qkv_benchmarks import report

    load_avg = record.get("load")
    busy = ""
    if load_avg:
        busy = (f"; load average {load_avg['before']:.1f} before and {load_avg['after']:.1f} after on "
                f"{record['machine']['cores']} cores")
        if max(load_avg["before"], load_avg["after"]) > 0.5 * record["machine"]["cores"]:
            busy += ": a loaded machine, so the times say little about this CPU's speed"
    source = f"; the record: [{name}.json](bench/{name}.json)" if name else ""
    lines = [f"`{record['command']}` (recorded {record['recorded']}{busy}{source}):", "",
             "```text", *report.header(record), *report.footer(record), "```", ""]
    for table in report.tables(record):
        lines += [f"**{table.title}**", "", table.markdown(), ""]
        if table.notes:
            lines += ["```text", *table.notes, "```", ""]
    return "\n".join(lines)


def render_experiment(name: str, command: str | None, docs: Path = DOCS) -> str:
    """The Markdown of ``docs/NAME.json``, an experiment's record: the command that wrote it,
    then the experiment's own table of it."""
    import importlib

    if name not in EXPERIMENTS:
        raise ValueError(f"experiment must be one of {sorted(EXPERIMENTS)}; got {name!r}")
    if not command:
        raise ValueError(f"the marker of experiment {name!r} must name its command: "
                         f"<!-- experiment: {name} | qkv experiment {name} ... -->")
    path = docs / f"{name}.json"
    record = json.loads(path.read_text())
    table = importlib.import_module(EXPERIMENTS[name]).format_table(record)
    return f"`{command}` wrote [`{path.name}`]({path.name}):\n\n{table}\n\n"


def regenerate(text: str, bench: Path = BENCH, docs: Path = DOCS) -> str:
    """``text`` with every marked block replaced by what its record renders to."""
    def block(m):
        if m.group("kind") == "experiment":
            body = render_experiment(m.group("name"), m.group("command"), docs)
        else:
            body = render(load(m.group("name"), bench), m.group("name"))
        return m.group(1) + body + m.group("end")
    return BLOCK.sub(block, text)


def pages(docs: Path = DOCS) -> list[Path]:
    """The Markdown pages that hold at least one marked block."""
    return sorted(p for p in docs.rglob("*.md") if BLOCK.search(p.read_text()))


def record(name: str, command: list[str], bench: Path = BENCH) -> Path:
    """Run ``command`` (a ``qkv bench`` line, without ``--json``) with ``--json`` to a temporary
    file, then store its results with the command, the time and the load in ``bench/NAME.json``."""
    if "--json" in command:
        raise ValueError("leave --json out of the command: the recorder adds its own")
    if not command or Path(command[0]).name != "qkv" or command[1:2] != ["bench"]:
        raise ValueError(f"the command must be a `qkv bench ...` line; got {shlex.join(command)!r}")
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "bench.json")
        subprocess.run([*command, "--json", str(out)], check=True)
        results = json.loads(out.read_text())
    after = os.getloadavg()[0]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    typed = shlex.join(["qkv", *command[1:]])  # as a reader types it, whatever path ran it
    results = {"command": typed, "recorded": now, "load": {"before": before, "after": after}, **results}
    bench.mkdir(exist_ok=True)
    path = bench / f"{name}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        if len(argv) < 4 or argv[2] != "--":
            print("usage: python docs/tables.py record NAME -- qkv bench [options]", file=sys.stderr)
            return 2
        print(f"stored {record(argv[1], argv[3:])}")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        old = page.read_text()
        new = regenerate(old)
        if new != old:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    verb = "stale" if args.check else "rewrote"
    for page in stale:
        print(f"{verb}: {page.relative_to(DOCS.parent)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
