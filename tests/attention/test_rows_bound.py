"""Each row's own largest key norm (qkv.kernels.flash.rows_bound): the key runs a row sees,
their range maxima and the masked rows' maxima, against a brute force over ``spec.allowed``."""
from dataclasses import replace

import numpy as np
import pytest

from qkv.kernels.flash import rows_bound
from qkv.masks import build_spec

SPECS = {
    "none": {},
    "causal": dict(causal=True),
    "bottom_right": dict(causal="bottom_right"),
    "window": dict(window=(5, 3)),
    "causal window": dict(causal=True, window=7),
    "chunk": dict(causal=True, chunk=6),
    "chunk bottom_right": dict(causal="bottom_right", chunk=4),
    "lengths": dict(causal="bottom_right", kv_lengths=np.array([30, 11]), q_lengths=np.array([20, 9])),
    "window lengths": dict(window=(4, 2), kv_lengths=np.array([0, 17])),
}


def brute(spec, norms, batch, q0, q1, head=None) -> np.ndarray:
    """max ‖k_j‖ over the keys row i may see (0 where none), from the (rows, Tk) mask."""
    ok = spec.allowed(q0, q1, 0, spec.tk, index=(batch, 0) if head is None else head)
    ok = np.ones((q1 - q0, spec.tk), bool) if ok is None else ok
    if spec.bias is not None:
        ok = ok & (spec.additive(q0, q1, 0, spec.tk, index=head) > -np.inf)
    return np.where(ok, norms, 0).max(axis=1, initial=0)


@pytest.mark.parametrize("how", list(SPECS))
@pytest.mark.parametrize("tq,tk", [(20, 30), (30, 20), (1, 17), (25, 25)])
def test_row_runs_and_range_maxima_are_the_rows_own(how, tq, tk):
    opts = dict(SPECS[how])
    if "kv_lengths" in opts:
        opts["kv_lengths"] = np.minimum(opts["kv_lengths"], tk)
        opts["q_lengths"] = None if "q_lengths" not in opts else np.minimum(opts["q_lengths"], tq)
    spec = build_spec((2, 3), tq, tk, **opts)
    norms = np.random.default_rng(tq * tk).random(tk).astype(np.float32) + 0.5
    for batch in range(2):
        for q0, q1 in [(0, tq), (tq // 3, tq // 3 + 7)]:
            q1 = min(q1, tq)
            if q0 >= q1:
                continue
            lo, hi = rows_bound.row_runs(spec, batch, q0, q1)
            ok = spec.allowed(q0, q1, 0, tk, index=(batch, 0))
            ok = np.ones((q1 - q0, tk), bool) if ok is None else ok
            j = np.arange(tk)
            np.testing.assert_array_equal(ok, (j >= lo[:, None]) & (j < hi[:, None]))  # one run a row
            np.testing.assert_array_equal(rows_bound.range_max(norms, lo, hi), brute(spec, norms, batch, q0, q1))
            got = rows_bound.row_kmax(spec, norms, [(batch, 0), (batch, 2)], q0, q1, (0, tk))
            np.testing.assert_array_equal(got, np.tile(brute(spec, norms, batch, q0, q1), 2))


def test_a_ring_block_reads_global_positions():
    """A block of a longer sequence (k_start, q_start): the runs follow the global positions."""
    spec = replace(build_spec((1,), 12, 16, causal=True, chunk=5), q_start=20, k_start=14)
    norms = np.arange(1, 17, dtype=np.float64)
    lo, hi = rows_bound.row_runs(spec, 0, 0, 12)
    ok = spec.allowed(0, 12, 0, 16, index=(0,))
    np.testing.assert_array_equal(ok, (np.arange(16) >= lo[:, None]) & (np.arange(16) < hi[:, None]))
    np.testing.assert_array_equal(rows_bound.range_max(norms, lo, hi), np.where(ok, norms, 0).max(axis=1))


def test_a_mask_and_a_bias_hide_keys_row_by_row():
    """A user mask's False and a bias's -inf leave a key out of the row's maximum; a finite
    bias, however negative, does not."""
    rng = np.random.default_rng(1)
    tq, tk = 9, 13
    mask = rng.random((2, tq, tk)) > 0.4
    bias = np.where(rng.random((2, tq, tk)) > 0.5, -np.inf, np.float32(np.finfo(np.float32).min))
    norms = rng.random(tk) + 0.5
    for opts in (dict(mask=mask), dict(bias=bias), dict(mask=mask, bias=bias, causal=True)):
        spec = build_spec((2,), tq, tk, **opts)
        got = rows_bound.row_kmax(spec, norms, [(0,), (1,)], 2, 8, (0, tk))
        want = np.concatenate([brute(spec, norms, None, 2, 8, head=(h,)) for h in (0, 1)])
        np.testing.assert_array_equal(got, want)
