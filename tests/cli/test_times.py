"""The times the README and the guide state are their records (issue 61): docs/bench/times.json,
written by ``python docs/times.py record NAME LABEL -- COMMAND``, a quiet and a loaded run of each
of the README's commands; the pages quote each record's wall seconds."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMES = json.loads((ROOT / "docs" / "bench" / "times.json").read_text())
NAMES = ("first-command", "explain", "quick-try", "suite")


def test_every_command_has_a_quiet_and_a_loaded_record():
    for name in NAMES:
        assert set(TIMES[name]) == {"quiet", "loaded"}, name
        for label, entry in TIMES[name].items():
            assert entry["wall_s"] > 0 and entry["cpu_s"] > 0 and entry["command"], (name, label)
        assert TIMES[name]["loaded"]["load"]["mean"] > TIMES[name]["quiet"]["load"]["mean"], name


def test_the_readme_quotes_the_records():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How long things take", 1)[1].split("\n## ", 1)[0]
    for name in NAMES:
        row = next(line for line in section.splitlines() if f"<!-- {name} -->" in line)
        for label in ("quiet", "loaded"):
            entry = TIMES[name][label]
            assert f"{entry['wall_s']:.0f} s" in row and f"{entry['load']['mean']:.1f}" in row, (name, label, row)


def test_the_guide_quotes_them_too():
    install, gpt = ((ROOT / "docs" / page).read_text() for page in ("install.md", "gpt.md"))
    first, quick = TIMES["first-command"], TIMES["quick-try"]
    for label in ("quiet", "loaded"):
        assert f"{first[label]['wall_s']:.0f} s" in install, label
        assert f"{quick[label]['wall_s']:.0f} s" in gpt, label
