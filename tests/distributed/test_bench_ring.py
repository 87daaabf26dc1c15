"""`mpiexec -n W qkv bench --suite ring`: the ring suite wired into the command, under a real
mpiexec (subprocesses with a timeout): rank 0 alone reports, and an exception on one rank ends
the whole job instead of leaving the other ranks waiting in a collective.

No timing is asserted: speed claims live in the benchmark's output, not in tests.
"""
import json

import pytest
from helpers import mpiexec

pytest.importorskip("rich", reason="qkv bench needs the cli extra (rich)")
pytest.importorskip("mpi4py", reason="the ring suite needs the mpi extra (mpi4py with mpich)")

from qkv_benchmarks.suites import QUICK  # noqa: E402

pytestmark = pytest.mark.slow  # subprocesses, mpiexec or compilers: the slow leg (pytest -m slow)


def test_two_ranks_run_the_quick_ring_suite_and_rank_0_reports(tmp_path):
    out = tmp_path / "ring.json"
    res = mpiexec(2, "-m", "qkv", "bench", "--suite", "ring", "--quick", "--no-torch", "--json", str(out),
                  timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("qkv bench: ") == 1 and res.stdout.count("json: ") == 1   # one rank printed
    assert "2 MPI ranks (ring suite)" in res.stdout and "ring attention over MPI" in res.stdout
    data = json.loads(out.read_text())
    assert data["mpi_ranks"] == 2 and data["skipped"] == {} and data["main"] == []
    assert [r["layout"] for r in data["ring"]] == ["zigzag", "contiguous"]
    size = QUICK["ring"]
    kv = 2 * (size["t"] // 2) * size["d"] * 4                 # |K| + |V| of one rank, float32, one head
    for r in data["ring"]:
        assert (r["W"], r["T"], r["D"]) == (2, size["t"], size["d"])
        assert r["sent_bytes"] == kv + kv + 2 * kv           # forward, then backward with dK, dV home
        assert len(r["compute_s"]) == len(r["peak_mib"]) == 2 and r["balance"] >= 1
    assert data["ring"][0]["ratio"] > 0 and "ratio" not in data["ring"][1]   # one process: zigzag only
    assert data["ring_pingpong_gb_s"] > 0 and "ping-pong between ranks 0 and 1" in res.stdout


FAIL_ON_RANK_1 = """
import sys
from mpi4py import MPI
import qkv.distributed.ring as ring


class Broken:  # the kernel the ring calls, failing on one rank only, inside a step
    @staticmethod
    def forward(*a, **kw):
        raise RuntimeError("injected failure inside a ring step on rank 1")

    backward = forward


if MPI.COMM_WORLD.Get_rank() == 1:
    ring.flash = Broken
from qkv.cli import main
sys.exit(main(["bench", "--suite", "ring", "--quick", "--no-torch"]))
"""


def test_an_exception_on_one_rank_ends_the_whole_job():
    """Not run under `python -m mpi4py`: the command itself aborts the job. Without that, rank 0
    waits for rank 1's block forever (the timeout would fire)."""
    res = mpiexec(2, "-c", FAIL_ON_RANK_1, timeout=60)
    assert res.returncode != 0
    assert "injected failure inside a ring step on rank 1" in res.stderr
    assert "MPI_Abort" in res.stdout + res.stderr
