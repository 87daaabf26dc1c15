"""numba passes of a short causal depthwise convolution (causal_conv1d's functions, served by
:mod:`qkv.torch.hf_kernels.conv`): a decoding step's (``causal_conv1d_update``) and a prefill's
blocks of time steps, channel-last (``causal_conv1d_fn`` without a gradient, :func:`conv_rows`);
load it through ``qkv.jit.load(qkv.jit.CONV)`` only.

torch's path is a dozen calls of a few µs over ``(B, D, L + T)`` numbers (a concatenation, the
K windows, a product and K - 1 ``addcmul_``, the state's copy) for some 9,000 multiply-adds at
D = 2176, K = 4: the whole call 53 µs a token, 36 with this pass (which takes 20 of them, a
channel at a time; one thread, this project's Xeon). :func:`conv_step` is one pass that rounds as
those calls round: the first tap a product, each later one a fused multiply-add into the sum
(torch's ``addcmul_`` is an FMA on these CPUs, vector loop and tail alike), the bias added
after; SiLU stays torch's (the caller's), on the same tensor.
"""
from __future__ import annotations

import numba
import numpy as np
from numba.core.extending import intrinsic


@intrinsic
def fma(typingctx, a, b, c):
    """``a · b + c`` rounded once (LLVM's ``fma``), of one float type."""
    def codegen(context, builder, sig, args):
        return builder.fma(*args)
    return a(a, b, c), codegen


@numba.njit(nogil=True, cache=True)
def conv_step(state, x, w, bias, out):
    """T new inputs after ``state (B, D, L)`` (oldest first, ``L >= K - 1``): ``out (B, D, T)``,
    ``out_t = Σ_k w_k xp_{t + k}`` over the last K - 1 states and the inputs ``x (B, D, T)``,
    ``w (D, K)``, plus ``bias (D,)`` (or of length 0: none); then ``state`` holds the last L
    of states and inputs, in place."""
    Bsz, Dd, L = state.shape
    T, K = x.shape[2], w.shape[1]
    has_bias = bias.shape[0] > 0
    win = np.empty(L + T, state.dtype)
    for b in range(Bsz):
        for d in range(Dd):
            for i in range(L):
                win[i] = state[b, d, i]
            for t in range(T):
                win[L + t] = x[b, d, t]
            for t in range(T):
                base = L - (K - 1) + t
                acc = win[base] * w[d, 0]
                for k in range(1, K):
                    acc = fma(win[base + k], w[d, k], acc)
                if has_bias:
                    acc = acc + bias[d]
                out[b, d, t] = acc
            for i in range(L):
                state[b, d, i] = win[T + i]


@numba.njit(nogil=True, cache=True)
def conv_rows(head, x, bs, rs, w, bias, t0, n, out):
    """Time steps ``[t0, t0 + n)`` of a prefill, channel-last: ``out[b, t] = Σ_k w_k xp_{t - (K - 1) + k}``
    (plus ``bias``, of length 0: none), rounded as :func:`conv_step` rounds (the first tap a
    product, each later one an FMA into the sum, the bias added after). ``xp`` is ``head (B, K - 1, D)``
    (the inputs before t = 0) then the input, whose step t of batch row b is ``x[b·bs + t·rs :][:D]``
    (``x`` flat: a split of a wider projection is read in place); ``w (K, D)`` the taps by rows;
    ``out (B, T, D)``. A step's taps go across its channels, contiguous in every operand."""
    Bsz, Dd = out.shape[0], out.shape[2]
    K = w.shape[0]
    has_bias = bias.shape[0] > 0
    for b in range(Bsz):
        for t in range(t0, t0 + n):
            o = out[b, t]
            for k in range(K):
                s = t - (K - 1) + k                                  # the input step this tap reads
                wk = w[k]
                if s < 0:
                    src = head[b, s + K - 1]
                else:
                    src = x[b * bs + s * rs:b * bs + s * rs + Dd]
                if k == 0:
                    for d in range(Dd):
                        o[d] = src[d] * wk[d]
                else:
                    for d in range(Dd):
                        o[d] = fma(src[d], wk[d], o[d])
            if has_bias:
                for d in range(Dd):
                    o[d] = o[d] + bias[d]

