"""The benchmark's one timing loop and its plan: call order, warm-ups, progress counts.

These use stand-in callables and count calls; no time is asserted.
"""
import pytest

from qkv import ShapeError
from qkv_benchmarks import suites
from qkv_benchmarks.report import Table
from qkv_benchmarks import timing
from qkv_benchmarks.timing import alternate, rounds, walls


def _recorder():
    calls = []

    def make(name):
        return lambda: calls.append(name)
    return calls, make


@pytest.mark.parametrize("rewarm_below, expected", [
    (0.0, ["a", "b", "a", "b", "a", "b"]),                              # warm-up each, then alternate
    (float("inf"), ["a", "b", "a", "a", "b", "b", "a", "a", "b", "b"]),  # each timed run re-warmed first
])
def test_alternate_warms_up_then_alternates(rewarm_below, expected, monkeypatch):
    monkeypatch.setattr(timing, "SETTLE_S", 0.0)  # one re-warm call (see the settle test below)
    calls, make = _recorder()
    ticks = []
    med = alternate({"a": make("a"), "b": make("b")}, 2, rewarm_below=rewarm_below, tick=lambda: ticks.append(1))
    assert calls == expected
    assert len(ticks) == 2 * (1 + 2)               # warm-ups and timed runs, never the re-warms
    assert set(med) == {"a", "b"} and all(set(m) == {"wall", "cpu"} for m in med.values())
    assert all(m["wall"] >= 0 and m["cpu"] >= 0 for m in med.values())
    assert walls(med) == {k: m["wall"] for k, m in med.items()}


def test_a_short_side_settles_on_its_own_calls_before_each_timed_run(monkeypatch):
    """Re-warm calls repeat until SETTLE_S of the side's own work has passed (each stand-in
    call advances a fake clock by 8 ms: three re-warm calls before each timed one at 20 ms)."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing, "SETTLE_S", 0.02)
    calls = []

    def make(name):
        def call():
            calls.append(name)
            now[0] += 0.008
        return call
    rounds({"a": make("a"), "b": make("b")}, 2, rewarm_below=float("inf"))
    assert calls == ["a", "b"] + ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4


def test_plan_resolves_suites_and_defaults():
    assert suites.plan(None).suites == suites.DEFAULT == ("main", "sweep", "decode", "encoder")  # torch, ring: named
    assert suites.plan(None, quick=True).suites == suites.QUICK_DEFAULT          # no encoder unless asked
    assert suites.plan(["all"], quick=True).suites == suites.SUITES
    assert suites.plan(["ring", "torch"]).suites == ("torch", "ring")
    assert suites.plan(["decode", "main"]).suites == ("main", "decode")         # in the suite order
    p = suites.plan(None, quick=True, torch=False, threads=3)
    assert (p.repeats, p.threads, p.torch, p.sizes) == (suites.QUICK["repeats"], 3, False, suites.QUICK)
    with pytest.raises(ShapeError, match="suites must be among"):
        suites.plan(["mian"])
    with pytest.raises(ShapeError, match="repeats must be an int >= 1; got 0"):
        suites.plan(None, repeats=0)


def test_progress_is_told_of_every_step_it_counted():
    p = suites.plan(["main", "decode"], quick=True, torch=False, memory=False)
    advanced, said = [], []

    def progress(advance, description=None):
        advanced.append(advance)
        if description:
            said.append(description)
    results = suites.run_suites(p, progress)
    # qkv, dense, products; softcap and dropout against plain; decode + copy
    assert sum(advanced) == suites.count_steps(p) == 4 * 3 * 2 + 2 * 2 * 2 + 3 * 2
    assert said == ["main: fwd full", "main: fwd causal", "main: fwd+bwd full", "main: fwd+bwd causal",
                    "main: fwd+bwd softcap=50", "main: fwd+bwd dropout_p=0.1", "decode"]
    assert results["sweep"] == [] and len(results["main"]) == 4 and results["torch"] is None
    assert set(results["decode"][0]["seconds"]) == {"qkv", "dense"}


def test_rounds_rotate_the_first_side_when_asked():
    calls, make = _recorder()
    runs = rounds({"a": make("a"), "b": make("b"), "c": make("c")}, 3, rewarm_below=0.0, rotate=True)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(r) == 3 and all(w >= 0 and c >= 0 for w, c in r) for r in runs.values())


def test_torch_and_ring_steps_are_counted():
    p = suites.plan(["torch", "ring"], quick=True, torch=True)
    labels = suites.torch_suite_steps(p)
    assert labels[:2] == ["plain forward", "plain forward+backward"] and len(labels) == 3 * 2  # no memory: quick
    assert len(suites.torch_suite_steps(suites.plan(["torch"], torch=True))) == 3 * 2 * 2   # full: + peak memory
    assert suites.count_steps(p) == len(labels) + len(suites.RING_LAYOUTS) + 1


def test_memory_processes_one_per_method_when_quick_one_per_size_else():
    quick = suites._memory_jobs(suites.plan(None, quick=True, torch=True))
    assert quick == [("qkv", [128, 256, 512]), ("dense", [128, 256, 512])]  # torch: not in a quick run
    full = suites._memory_jobs(suites.plan(None, torch=False))
    assert ("dense", [16384]) not in full and ("qkv", [16384]) in full     # dense only up to dense_max
    assert all(len(ts) == 1 for _, ts in full)


def test_table_renders_as_aligned_text():
    t = Table("title", ["case", "s"], [["fwd", "0.5"], ["fwd+bwd", "12.25"]], left=1, notes=["a note"])
    assert str(t).splitlines() == ["title",
                                   "case         s",
                                   "fwd        0.5",
                                   "fwd+bwd  12.25",
                                   "a note"]
    assert t.markdown().splitlines() == ["| case | s |", "|---|---:|", "| fwd | 0.5 |", "| fwd+bwd | 12.25 |"]
