"""qkv.torch.hf_kernels at its edges: what one packed sequence holds stays in it (a NaN or inf
included), a decoding step refuses two batch rows on one state row, and fla's functions refuse
zero heads by name instead of failing inside."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import qkv  # noqa: E402
from qkv.torch import hf_kernels as K  # noqa: E402

CUTS = [0, 6, 8, 19, 23]         # four packed sequences, one of 2 tokens (shorter than the conv)


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def seq_idx(cuts=CUTS):
    ids = torch.zeros(1, cuts[-1], dtype=torch.int32)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        ids[0, a:b] = i
    return ids


def poison(x, time_axis, a, b):
    """``x`` with NaN, inf and -inf written into positions a..b-1 along ``time_axis``."""
    x = x.clone()
    first = x.narrow(time_axis, a, b - a)
    first.select(time_axis, 0).fill_(float("nan"))
    first.select(time_axis, 1).view(-1)[::2] = float("inf")
    first.select(time_axis, b - a - 1).view(-1)[::3] = -float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channel_last", [False, True])
def test_packed_conv_keeps_nan_and_inf_in_their_sequence(dtype, channel_last):
    """causal_conv1d_fn(seq_idx=...) with NaN and inf in the first sequence: every other sequence
    is the bits of its own call alone (once NaN · 0 carried the NaN into the next K - 1 outputs)."""
    D, T = 12, CUTS[-1]
    x = rand(1, T, D, dtype=dtype).transpose(1, 2) if channel_last else rand(1, D, T, dtype=dtype)
    w, b = rand(D, 4, seed=1, dtype=dtype), rand(D, seed=2, dtype=dtype)
    bad = poison(x, 2, CUTS[0], CUTS[1])
    out = K.causal_conv1d_fn(bad, w, b, seq_idx=seq_idx(), activation="silu")
    assert torch.isnan(out[:, :, :CUTS[1]]).any()                        # the poisoned sequence keeps it
    for a, e in zip(CUTS[1:], CUTS[2:]):
        alone = K.causal_conv1d_fn(x[:, :, a:e], w, b, activation="silu")
        assert torch.equal(out[:, :, a:e], alone), (a, e)


def _split_args(H=4, P=8, G=2, N=5, width=4):
    dim, conv_dim = H * P, H * P + 2 * G * N
    args = dict(conv1d_weight=rand(conv_dim, width, seed=1), conv1d_bias=rand(conv_dim, seed=2),
                dt_bias=rand(H, seed=3), A=-torch.linspace(0.5, 2.0, H, dtype=torch.float64), D=rand(H, seed=4),
                chunk_size=8, rmsnorm_weight=rand(dim, seed=5), outproj_weight=rand(16, dim, seed=6), headdim=P,
                ngroups=G)
    return args, 2 * dim + 2 * G * N + H, dim, conv_dim


def test_fused_mamba_keeps_nan_and_inf_in_their_sequence():
    """mamba_split_conv1d_scan_combined(seq_idx=...) with NaN and inf in the first sequence's x, B,
    C and z: the others are the bits of the same packed call without them, and their call alone to
    float64 rounding (the conv once carried the NaN over, and the scan on)."""
    args, width, dim, conv_dim = _split_args()
    zx = rand(1, CUTS[-1], width, seed=7)
    bad = zx.clone()
    bad[:, :CUTS[1], :dim + conv_dim] = poison(zx[:, :CUTS[1], :dim + conv_dim], 1, 0, CUTS[1])
    out = K.mamba_split_conv1d_scan_combined(bad, seq_idx=seq_idx(), **args)
    clean = K.mamba_split_conv1d_scan_combined(zx, seq_idx=seq_idx(), **args)
    assert torch.isnan(out[:, :CUTS[1]]).any()
    assert torch.equal(out[:, CUTS[1]:], clean[:, CUTS[1]:])
    for a, e in zip(CUTS[1:], CUTS[2:]):
        alone = K.mamba_split_conv1d_scan_combined(zx[:, a:e], **args)
        assert torch.allclose(out[:, a:e], alone, rtol=1e-12, atol=1e-12), (a, e)


def test_decoding_steps_keep_a_poisoned_row_to_itself():
    """causal_conv1d_update and selective_state_update with NaN and inf in one batch row's state and
    input: the other rows are their own step alone to float64 rounding (a guard: they never mixed
    rows). Not bit for bit: torch runs an element-wise op (softplus, exp, silu) vectorized on whole
    vectors and scalar on the tail, and which of a row's entries fall in the tail depends on the
    batch around it (on AVX-512, softplus of row 1 of 3 differs in its last bit from row 1 alone)."""
    def same(a, b):
        return torch.allclose(a, b, rtol=1e-13, atol=1e-14) and bool(torch.isfinite(a).all())

    D, L, H, P, N = 6, 3, 2, 4, 5
    x, state, w = rand(3, D, 2), rand(3, D, L, seed=1), rand(D, 4, seed=2)
    bad_x, bad_state = x.clone(), state.clone()
    bad_x[0, 0, 0], bad_state[0, 1, :] = float("nan"), float("inf")
    out = K.causal_conv1d_update(bad_x, bad_state, w, activation="silu")
    for r in (1, 2):
        one_state = state[r:r + 1].clone()
        assert same(out[r:r + 1], K.causal_conv1d_update(x[r:r + 1], one_state, w, activation="silu"))
        assert same(bad_state[r:r + 1], one_state)
    ss, xs, dt = rand(3, H, P, N, seed=3), rand(3, H, P, seed=4), rand(3, H, P, seed=5)
    A, B, C = -rand(H, P, N, seed=6).abs(), rand(3, 1, N, seed=7), rand(3, 1, N, seed=8)
    bad_ss, bad_xs = ss.clone(), xs.clone()
    bad_ss[0, 0, 0, 0], bad_xs[0, 1, 2] = float("nan"), -float("inf")
    out = K.selective_state_update(bad_ss, bad_xs, dt, A, B, C, dt_softplus=True)
    for r in (1, 2):
        one = ss[r:r + 1].clone()
        step = K.selective_state_update(one, xs[r:r + 1], dt[r:r + 1], A, B[r:r + 1], C[r:r + 1], dt_softplus=True)
        assert same(out[r:r + 1], step) and same(bad_ss[r:r + 1], one)


def test_duplicate_state_batch_indices_are_refused_by_name():
    """Two batch rows stepping one state row: the last write won silently; now refused, the state
    untouched."""
    H, P, N = 2, 4, 5
    state = rand(4, H, P, N)
    before = state.clone()
    x, dt = rand(3, H, P, seed=1), rand(3, H, P, seed=2)
    A, B, C = -rand(H, P, N, seed=3).abs(), rand(3, 1, N, seed=4), rand(3, 1, N, seed=5)
    with pytest.raises(qkv.ShapeError, match=r"state_batch_indices must name distinct rows .*\[2, 0, 2\].*\[2\]"):
        K.selective_state_update(state, x, dt, A, B, C, state_batch_indices=torch.tensor([2, 0, 2]))
    assert torch.equal(state, before)
    K.selective_state_update(state, x, dt, A, B, C, state_batch_indices=torch.tensor([2, 0, 3]))   # distinct: fine


def test_duplicate_conv_state_indices_are_refused_by_name():
    """The same for causal_conv1d_update's conv_state_indices."""
    conv_state = rand(4, 6, 3)
    before = conv_state.clone()
    with pytest.raises(qkv.ShapeError, match=r"conv_state_indices must name distinct rows .*\[1\]"):
        K.causal_conv1d_update(rand(2, 6, seed=1), conv_state, rand(6, 4, seed=2),
                               conv_state_indices=torch.tensor([1, 1], dtype=torch.int32))
    assert torch.equal(conv_state, before)


FLA = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"]


@pytest.mark.parametrize("name", FLA)
@pytest.mark.parametrize("T", [5, 1])
@pytest.mark.parametrize("H, Kd", [(0, 4), (2, 0)])
def test_fla_functions_refuse_zero_heads_or_key_width_by_name(name, T, H, Kd):
    """H = 0 gave ``integer modulo by zero`` (K = 0 a ZeroDivisionError in the default scale):
    a ShapeError naming q's layout now, in the chunked and the decoding-step paths."""
    q, k, v = rand(1, T, H, Kd), rand(1, T, H, Kd, seed=1), rand(1, T, H, 4, seed=2)
    beta = torch.rand(1, T, H, dtype=torch.float64)
    g = -torch.rand(1, T, H, *(() if "gated" in name else (Kd,)), dtype=torch.float64)
    with pytest.raises(qkv.ShapeError, match=rf"{name}: q must have at least one head and one key channel.*"
                                             rf"got \(1, {T}, {H}, {Kd}\)"):
        getattr(K, name)(q, k, v, g=g, beta=beta)
