"""qkv bench --suite gpt: the GPU recipe's size step can be left out, and its time left is honest
(issue 61): the progress counts it at its weight in CPU-recipe steps, not as one."""
import pytest

from qkv.cli import build_parser

suites = pytest.importorskip("qkv_benchmarks.suites")
gpt_suite = pytest.importorskip("qkv_benchmarks.gpt_suite")


def test_the_flag_leaves_the_gpu_size_step_out_of_the_plan_and_the_count():
    args = build_parser().parse_args(["bench", "--suite", "gpt", "--no-gpu-size"])
    assert args.no_gpu_size
    with_it, without = suites.plan(["gpt"]), suites.plan(["gpt"], gpu_size=False)
    assert with_it.gpu_size and not without.gpu_size
    sides = len(gpt_suite.SIDES)
    assert suites.count_steps(with_it) - suites.count_steps(without) == sides * gpt_suite.gpu_size_weight()


def test_the_gpu_size_step_weighs_what_its_arithmetic_weighs():
    # 2 steps of 16,384 tokens through 6 blocks of width 384, against 768 tokens through 4 of 128
    assert 400 < gpt_suite.gpu_size_weight() < 800


@pytest.mark.slow
def test_measure_without_the_gpu_size_step_runs_none(monkeypatch, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 400)
    called = []
    monkeypatch.setattr(gpt_suite, "_gpu_size", lambda *a: called.append(a) or [])
    monkeypatch.setattr(gpt_suite, "run_child", lambda *a, **k: None)
    rows = gpt_suite.measure(quick=False, steps=2, threads=1, torch=False, memory=False, gpu_size=False,
                             data=str(text), progress=lambda *a, **k: None)
    assert not called and {r["recipe"] for r in rows} == {"cpu"}
