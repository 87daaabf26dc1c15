"""A first run that says what it does (issue 61): while the fast extra's kernels compile, the progress
line says so with its elapsed time instead of a time left, and the estimate leaves compiling out."""
import pytest

from qkv import jit_cache
from qkv.cli import progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def compile_clock(monkeypatch):
    """jit_cache's compile state driven by the test: ``state["now"]`` seconds into a compile (None:
    none running), ``state["total"]`` seconds compiled in all."""
    state = {"now": None, "total": 0.0}
    monkeypatch.setattr(jit_cache, "compiling", lambda: state["now"])
    monkeypatch.setattr(jit_cache, "compile_total", lambda: state["total"])
    return state


def test_the_line_says_compiling_and_no_time_left_while_kernels_compile(compile_clock):
    clock = Clock()
    lines = progress.Lines("gpt", 200, ("loss",), clock=clock)
    compile_clock.update(now=12.0, total=41.0)   # a second compile, 12 s into it, after 29 s of one
    clock.now = 41.0
    line = lines.line()
    assert "compiling (first run on this CPU) 41s" in line and "left" not in line and "0/200" in line


def test_the_estimate_starts_after_compiling_from_the_steps_own_pace(compile_clock):
    clock = Clock()
    lines = progress.Lines("gpt", 200, clock=clock)
    compile_clock.update(now=None, total=300.0)    # five minutes compiling in the first step
    clock.now = 300.0 + 2 * 0.5                     # then two steps of half a second
    lines.update(2)
    line = lines.line()
    assert "~1m39s left" in line, line             # 198 steps at 0.5 s, not at 150 s a step
    assert "compiling" not in line


def test_compiling_before_the_count_started_is_not_its_time(compile_clock):
    compile_clock.update(total=100.0)
    clock = Clock()
    lines = progress.Lines("gpt", 10, clock=clock)
    clock.now = 5.0
    lines.update(5)
    assert "~5s left" in lines.line()


def test_left_needs_a_step_and_some_time():
    assert progress.left(0, 0, 10, 5.0, 0.0) is None
    assert progress.left(3, 0, 10, 5.0, 5.0) is None
    assert progress.left(4, 0, 10, 6.0, 2.0) == pytest.approx(6.0)


def test_the_compile_listener_reports_the_compile_in_progress():
    numba = pytest.importorskip("numba")
    jit_cache.install()
    if not jit_cache._notices:
        pytest.skip("numba's compile events are not listened to here (QKV_JIT=0 or no fast extra)")
    seen = []

    def probe(ev):
        seen.append(jit_cache.compiling())
    before = jit_cache.compile_total()

    @numba.njit
    def f(x):
        return x + 1

    notice = jit_cache._notices[0]
    real = type(notice).on_start

    def on_start(self, ev):
        real(self, ev)
        probe(ev)
    type(notice).on_start = on_start
    try:
        assert f(1) == 2
    finally:
        type(notice).on_start = real
    assert seen and seen[0] is not None and seen[0] >= 0
    assert jit_cache.compiling() is None and jit_cache.compile_total() > before
