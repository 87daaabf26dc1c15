"""causal_conv1d's ``causal_conv1d_fn`` and ``causal_conv1d_update`` on CPU tensors, under
the package's names and signatures (as transformers' Mamba, Mamba-2, Jamba, Bamba, Zamba2,
FalconH1, NemotronH and GraniteMoeHybrid call them), differentiable through autograd.

The causal depthwise convolution of width K over channels D::

    out[b, d, t] = act(bias[d] + Σ_{k < K} weight[d, k] · x[b, d, t - (K - 1) + k])

where ``x`` before t = 0 is the initial state (zeros without one) and ``act`` is None or
SiLU (``"silu"``, ``"swish"``). With ``seq_idx (B, T)``, packed sequences: a window term
whose position holds another sequence than t's (``seq_idx[b, s] != seq_idx[b, t]``) is
not there: each run of one id is convolved by the same call as that sequence alone, so with
the same bits, and nothing of one sequence, not even a NaN or inf, reaches another (a product
with a 0/1 mask would carry NaN · 0 = NaN over). This is no recurrence: K shifted multiply-adds
compute it.

``causal_conv1d_update`` is decoding: ``conv_state (B, D, L)``, L >= K - 1, holds the last
L inputs (oldest first); the new inputs are convolved after them and shift them out. With
``cache_seqlens (B,)`` the state is a ring buffer whose oldest entry is at
``cache_seqlens % L``, and the inputs are written from there; with ``conv_state_indices
(B,)`` the state is a larger tensor whose rows those are.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ... import jit, threads
from ...errors import OptionError, ShapeError, fmt_shape
from ..options import NUMPY_DTYPES, empty
from .decode import _array

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]

ACTIVATIONS = (None, "silu", "swish")


def _need(name: str, t, shapes: dict, required: bool = True):
    """``t`` is a tensor of one of ``shapes`` ({label: shape}); None passes where not required."""
    if t is None:
        if required:
            raise ShapeError(f"{name} is required")
        return None
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if tuple(t.shape) not in [tuple(s) for s in shapes.values()]:
        want = " or ".join(f"{lab} = {fmt_shape(s)}" for lab, s in shapes.items())
        raise ShapeError(f"{name} must have shape {want}; got {fmt_shape(t.shape)}")
    return t


def _need_int(name: str, t, shape: tuple, label: str):
    """An integer tensor of ``shape`` (sequence ids, lengths, indices) or None."""
    if t is None:
        return None
    _need(name, t, {label: shape})
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ShapeError(f"{name} must be an integer tensor; got {t.dtype}")
    return t


def distinct_rows(name: str, rows: torch.Tensor, of: str) -> None:
    """Indices of the rows of ``of`` that a step updates in place must differ: two batch rows
    stepping one state row would leave only the last write (which, on a GPU, is a race)."""
    values, counts = torch.unique(rows, return_counts=True)
    if (counts > 1).any():
        twice = values[counts > 1].tolist()
        raise ShapeError(f"{name} must name distinct rows of {of} (each batch row updates its own in place); got "
                         f"{rows.tolist()}, where {twice} {'comes' if len(twice) == 1 else 'come'} more than once")


def _activation(name: str, activation) -> bool:
    """True for SiLU; causal_conv1d computes None, "silu" and "swish" only."""
    if activation not in ACTIVATIONS:
        raise OptionError(f"{name} must be None, 'silu' or 'swish' (causal_conv1d's); got {activation!r}")
    return activation is not None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` (``t`` itself where it has that dtype) without the call where it would
    return ``t``: 1.8 µs a call, and a decoding step made a dozen (one thread, Zen 3)."""
    return t if t.dtype == dtype else t.to(dtype)


def _act(out: torch.Tensor, silu: bool) -> torch.Tensor:
    """SiLU on ``out``, a tensor of our own: in place where no gradient is recorded (the same
    numbers, a slab fewer to allocate)."""
    if not silu:
        return out
    return F.silu(out, inplace=not (torch.is_grad_enabled() and out.requires_grad))


def _tap_rows(weight: torch.Tensor, t_ax: int) -> tuple:
    """The K taps as :func:`_taps` multiplies them: ``(D, 1)`` views, or for channel-last contiguous
    rows of ``weightᵀ`` (a tap of stride K sent torch's broadcast multiply down a strided loop: 0.47
    against 0.07 ms a tap at D = 144, T = 2048)."""
    return weight[:, :, None].unbind(1) if t_ax == 2 else weight.t().contiguous().unbind(0)


def _taps(xp: torch.Tensor, weight: torch.Tensor, bias, T: int, t_ax: int, w: tuple | None = None,
          into: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution of ``xp`` (its K - 1 first steps the inputs before
    t = 0; time on axis ``t_ax``: 2 for ``(B, D, ·)``, 1 for ``(B, ·, D)``) as K shifted
    multiply-adds over whole slabs: torch's depthwise ``conv1d`` took 5 times as long
    (66-88 against 15 ms at D = T = 2048, float32), and 2.7 times more again on a channel-last
    input, the layout transformers' layers hand over (and with the taps contiguous, from D = 144
    up: 0.4-0.7x its time, Zen 3, one thread). ``w``: :func:`_tap_rows` where the caller has them;
    ``into``: where the taps are summed without a gradient (else a slab of NumPy's pages)."""
    K = weight.shape[1]
    w = _tap_rows(weight, t_ax) if w is None else w
    # a decoding step's K windows as views made by one call (a few µs of a step); where xp's
    # gradient is recorded each window is made as its product takes it, so that autograd sums
    # the windows' gradients into xp's in the same order (an unfold's would sum them otherwise)
    xs = xp.unfold(2, T, 1).unbind(2) if t_ax == 2 and not (torch.is_grad_enabled() and xp.requires_grad) else None
    plain = not (torch.is_grad_enabled() and (xp.requires_grad or weight.requires_grad))
    first = xp.narrow(t_ax, 0, T) if xs is None else xs[0]
    # recorded: torch's product; else the same product into NumPy's pages, laid out as torch lays it (options.empty)
    out = torch.mul(first, w[0], out=empty(first.shape, xp.dtype) if into is None else into) if plain else first * w[0]
    for k in range(1, K):
        out = out.addcmul_(xp.narrow(t_ax, k, T) if xs is None else xs[k], w[k])
    if bias is not None:   # in place, as the taps: out is ours, and the sum's gradient needs neither side
        out = out.add_(cast(bias, out.dtype)[:, None] if t_ax == 2 else cast(bias, out.dtype))
    return out


BLOCK = 1 << 16   # numbers of an output block of a channel-last convolution without a gradient (256 KiB in float32)
ALIGN = 64        # numbers: a block of a multiple of it starts torch's vector loops where one pass over the slab would


def _block_rows(width: int, K: int) -> int:
    """Time steps of a block of :func:`_blocked_taps`: about :data:`BLOCK` numbers, at least K, and
    a whole number of :data:`ALIGN` numbers where that keeps at least half the block (an odd width
    past ``BLOCK / ALIGN`` keeps its rows, unaligned, rather than blocks of K rows)."""
    rows = BLOCK // max(1, width)
    aligned = rows - rows % (ALIGN // math.gcd(width, ALIGN))
    return max(K, aligned if 2 * aligned >= rows else rows)


def _blocked_taps(head, xt, weight, bias, rows: int, silu: bool) -> torch.Tensor:
    """:func:`_taps` of a channel-last input without a gradient, a block of time steps at a time, so that
    a block's K multiply-adds, bias and SiLU find it in cache (over whole slabs each pass went to memory: at
    (1, 8192, 2048) float32, 64 MB each). Each pass is the one :func:`_taps` makes, a loop along the
    channels of each time step (the taps and the bias are broadcast over time) written straight into the
    output, so each number is rounded as there: the same bits. SiLU goes block by block where a block
    is a whole number of :data:`ALIGN` numbers (one batch row): torch's vector loop leaves the last
    numbers of each call to its scalar SiLU, whose bits differ (4 % of float32 numbers), and aligned
    blocks leave it exactly the numbers one pass over the slab would; else over the slab after.
    ``head (B, K - 1, D)`` the inputs before t = 0, ``xt (B, T, D)``; ``rows`` time steps a block
    (:func:`_block_rows`, at least K - 1). At (1, 8192, 2176), one thread: 58 -> 41 ms. A block's taps are
    one compiled call where that pass is there (:func:`_compiled_rows`), with the torch calls' bits."""
    K, (Bsz, T, Dd) = weight.shape[1], xt.shape
    out = empty((Bsz, T, Dd), xt.dtype)                                  # NumPy's pages (options.empty)
    w, each = _tap_rows(weight, 1), silu and Bsz == 1 and rows * Dd % ALIGN == 0
    fast = _compiled_rows(head, xt, w, bias, out)
    if fast is not None and (n := torch.get_num_threads()) > 1:          # torch's threads, as its calls had
        fast(0, T, n)
        return _act(out, silu)
    for t0 in range(0, T, rows):
        n = min(rows, T - t0)
        if fast is not None:
            fast(t0, n)
            block = out.narrow(1, t0, n)
        else:
            src = xt.narrow(1, t0 - (K - 1), n + K - 1) if t0 >= K - 1 else \
                torch.cat([head.narrow(1, t0, K - 1 - t0), xt.narrow(1, 0, t0 + n)], dim=1)   # the first block
            block = _taps(src, weight, bias, n, 1, w, into=out.narrow(1, t0, n))
        if each:
            F.silu(block, inplace=True)
    return _act(out, silu and not each)


def _compiled():
    """:mod:`qkv.kernels.conv_compiled` where its passes round as torch's calls: torch's vector loops
    (its AVX2 and AVX-512 builds, which every CPU with AVX2 runs) make ``addcmul_`` an FMA, as the
    passes do; its scalar build (``ATEN_CPU_CAPABILITY=default``, a CPU without AVX2) rounds the
    product first. None there, or without the compiled module: torch's calls."""
    return jit.load(jit.CONV) if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else None


def _compiled_rows(head, xt, w, bias, out):
    """``fill(t0, n)``: :func:`_blocked_taps`' steps ``[t0, t0 + n)`` written into ``out`` by one compiled
    call (:func:`qkv.kernels.conv_compiled.conv_rows`: the torch calls' roundings, so the same bits),
    the input read in place as the strided split it is; ``fill(0, T, threads)``: every step, in that many
    runs of steps on qkv's worker threads (torch's calls ran on its threads); None where that pass is
    not there or the operands do not share float32 or float64 (torch's calls then). A block of the
    torch calls was six calls of a few µs; at (1, 2048, 1152) in a row 2192 wide (a Mamba-2 mixer of
    hidden 512), one thread, this project's Xeon, the taps took 2.9 ms that way and 1.0 ms so."""
    dt = xt.dtype
    if dt not in (torch.float32, torch.float64) or head.dtype != dt or (bias is not None and bias.dtype != dt) \
            or xt.stride(2) != 1 or (fast := _compiled()) is None:
        return None
    Bsz, T, Dd = xt.shape
    bs, rs = xt.stride(0), xt.stride(1)
    x = xt.detach().numpy()
    flat = np.lib.stride_tricks.as_strided(x, shape=((Bsz - 1) * bs + (T - 1) * rs + Dd,), strides=(x.itemsize,),
                                           writeable=False)            # from x's first number to its last
    args = (_array(head, dt), flat, bs, rs, _array(torch.stack(w), dt),
            np.empty(0, x.dtype) if bias is None else _array(bias, dt))
    o = out.numpy()

    def fill(t0: int, n: int, parts: int = 1) -> None:
        if parts == 1:
            fast.conv_rows(*args, t0, n, o)
            return
        cuts = [t0 + n * p // parts for p in range(parts + 1)]            # the pass lets go of the GIL
        list(threads.pool(parts).map(lambda a, b: fast.conv_rows(*args, a, b - a, o), cuts[:-1], cuts[1:]))
    return fill


def sequence_runs(seq_idx: torch.Tensor) -> list:
    """``[[(start, end), ...] a batch row]``: the runs of one id in ``seq_idx (B, T)``, each a
    packed sequence (causal_conv1d's and mamba_ssm's rule: a new sequence where the id changes)."""
    T = seq_idx.shape[1]
    runs = []
    for row in seq_idx:
        cuts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), T]
        runs.append(list(zip(cuts[:-1], cuts[1:])) if T else [])
    return runs


def _per_sequence(x: torch.Tensor, weight, bias, seq_idx, activation) -> torch.Tensor:
    """The convolution of packed sequences ``x (B, D, T)``: each run of ``seq_idx`` convolved by
    the same call as that sequence alone (zeros before it, x's layout), so with the same bits,
    and no input of one sequence, not even a NaN or inf, reaches another's outputs (no product
    with a 0/1 mask, which turns NaN into NaN)."""
    rows = []
    for b, row in enumerate(sequence_runs(seq_idx)):
        pieces = [causal_conv1d_fn(x[b:b + 1, :, s:e], weight, bias, activation=activation) for s, e in row]
        rows.append(torch.cat(pieces, dim=2) if pieces else x[b:b + 1].to(weight.dtype).to(x.dtype))
    return torch.cat(rows, dim=0)                                       # (B, D, T)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d's ``causal_conv1d_fn``: the causal depthwise convolution (module docstring).

    Args:
        x: ``(B, D, T)``. weight: ``(D, K)``. bias: ``(D,)`` or None.
        seq_idx: ``(B, T)`` integer sequence ids of packed sequences, or None.
        initial_states: ``(B, D, K - 1)``, the inputs before t = 0, or None (zeros).
        return_final_states: also return the last K - 1 inputs ``(B, D, K - 1)``.
        final_states_out: ``(B, D, K - 1)`` written with the final states and returned.
        activation: None, ``"silu"`` or ``"swish"``.

    Returns:
        ``out (B, D, T)`` in x's dtype; with ``return_final_states``, ``(out, final_states)``.
        As causal_conv1d, ``seq_idx`` takes neither ``initial_states`` nor final states.
    """
    silu = _activation("activation", activation)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ShapeError(f"x must have shape (B, D, T); got "
                         f"{fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    Bsz, Dd, T = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != Dd:
        raise ShapeError(f"weight must have shape (D, K) = ({Dd}, K); got "
                         f"{fmt_shape(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    K = weight.shape[1]
    _need("bias", bias, {"(D,)": (Dd,)}, required=False)
    _need_int("seq_idx", seq_idx, (Bsz, T), "(B, T)")
    _need("initial_states", initial_states, {"(B, D, K - 1)": (Bsz, Dd, K - 1)}, required=False)
    _need("final_states_out", final_states_out, {"(B, D, K - 1)": (Bsz, Dd, K - 1)}, required=False)
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise OptionError("seq_idx takes neither initial_states nor return_final_states=True (as causal_conv1d: "
                          "the states of packed sequences are not one state); got "
                          f"initial_states={'a tensor' if initial_states is not None else None}, "
                          f"return_final_states={return_final_states!r}")
    if final_states_out is not None and not return_final_states:
        raise OptionError("final_states_out is written only with return_final_states=True; got "
                          f"return_final_states={return_final_states!r}")
    if seq_idx is not None:
        return _per_sequence(x, weight, bias, seq_idx, activation)
    xw = x.to(weight.dtype)
    # channel-last, as causal_conv1d takes it: channels contiguous, each time step's row D or more
    # apart (the mixers hand a split of their in_proj's output: rows as wide as that). Such an input
    # taken channel-first was gathered by its cat a time step at a time, and its output handed the
    # mixer x, B, C with time innermost (2.4 -> 0.6 ms a call, D = 640, T = 2048, Zen 3)
    last = Dd > 1 and xw.stride(1) == 1 and xw.stride(2) >= Dd
    xt = xw.transpose(1, 2) if last else xw                             # time on axis 1 (last) or 2
    t_ax = 1 if last else 2
    head = xw.new_zeros(Bsz, Dd, K - 1) if initial_states is None else initial_states.to(weight.dtype)
    head = head.transpose(1, 2) if last else head
    recorded = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (xt, head, weight, bias))
    rows = _block_rows(Bsz * Dd, K)
    if last and not recorded and T >= 2 * rows:
        out = _blocked_taps(head, xt, weight, bias, rows, silu).to(x.dtype)
    else:
        out = _act(_taps(torch.cat([head, xt], dim=t_ax), weight, bias, T, t_ax), silu).to(x.dtype)
    out = out.transpose(1, 2) if last else out                          # (B, D, T), x's layout
    if not return_final_states:
        return out
    xp = xt if T >= K - 1 else torch.cat([head, xt], dim=t_ax)
    final = xp.narrow(t_ax, xp.shape[t_ax] - (K - 1), K - 1).to(x.dtype)  # the last K - 1 inputs
    final = final.transpose(1, 2) if last else final                    # (B, D, K - 1)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _compiled_update(x3, conv_state, weight, bias) -> torch.Tensor | None:
    """The taps and the shifted state of :func:`causal_conv1d_update` in one compiled pass
    (:func:`qkv.kernels.conv_compiled.conv_step`, the torch steps' bits: the call 53 against
    36 µs a token at D = 2176, the checks and SiLU included), where no gradient is wanted and
    x, the state, the weight and the bias share float32 or float64; else None (torch's steps).
    ``out (B, D, T)`` before the activation."""
    dt = weight.dtype
    if dt not in (torch.float32, torch.float64) or any(t is not None and t.dtype != dt for t in (x3, conv_state, bias)) \
            or (fast := _compiled()) is None \
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x3, conv_state, weight, bias))):
        return None
    work = conv_state if conv_state.is_contiguous() else conv_state.contiguous()   # stepped, then put back
    out = np.empty(tuple(x3.shape), NUMPY_DTYPES[dt])
    fast.conv_step(_array(work, dt), _array(x3, dt), _array(weight, dt),
                   np.empty(0, NUMPY_DTYPES[dt]) if bias is None else _array(bias, dt), out)
    if work is not conv_state:
        conv_state.copy_(work)
    return torch.from_numpy(out)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """causal_conv1d's ``causal_conv1d_update``: T new inputs after the state, which is
    updated in place (module docstring).

    Args:
        x: ``(B, D)`` (one step) or ``(B, D, T)``.
        conv_state: ``(B, D, L)`` with L >= K - 1 (``(B', D, L)`` with ``conv_state_indices``).
        weight: ``(D, K)``. bias: ``(D,)`` or None. activation: None, ``"silu"``, ``"swish"``.
        cache_seqlens: ``(B,)`` integers: the state is a ring buffer written from
            ``cache_seqlens % L``; None: a shift register.
        conv_state_indices: ``(B,)`` integers: the rows of ``conv_state`` to use, or None.

    Returns:
        ``out`` of x's shape and dtype.
    """
    silu = _activation("activation", activation)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ShapeError(f"x must have shape (B, D) or (B, D, T); got "
                         f"{fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    one = x.dim() == 2
    x3 = x[:, :, None] if one else x
    Bsz, Dd, T = x3.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != Dd:
        raise ShapeError(f"weight must have shape (D, K) = ({Dd}, K); got "
                         f"{fmt_shape(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    K = weight.shape[1]
    _need("bias", bias, {"(D,)": (Dd,)}, required=False)
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3 or conv_state.shape[1] != Dd \
            or conv_state.shape[2] < K - 1 or (conv_state_indices is None and conv_state.shape[0] != Bsz):
        raise ShapeError(f"conv_state must have shape (B, D, L) = ({Bsz}, {Dd}, L) with L >= K - 1 = {K - 1}; got "
                         f"{fmt_shape(conv_state.shape) if isinstance(conv_state, torch.Tensor) else conv_state!r}")
    L = conv_state.shape[2]
    _need_int("cache_seqlens", cache_seqlens, (Bsz,), "(B,)")
    _need_int("conv_state_indices", conv_state_indices, (Bsz,), "(B,)")
    if conv_state_indices is not None and conv_state_indices.numel() and not (
            0 <= int(conv_state_indices.min()) and int(conv_state_indices.max()) < conv_state.shape[0]):
        raise ShapeError(f"conv_state_indices must lie in [0, {conv_state.shape[0]}) (rows of conv_state); got "
                         f"{conv_state_indices.tolist()}")
    if conv_state_indices is not None:
        distinct_rows("conv_state_indices", conv_state_indices, "conv_state")
    out = _compiled_update(x3, conv_state, weight, bias) if cache_seqlens is None and conv_state_indices is None else None
    if out is not None:
        out = cast(_act(out, silu), x.dtype)
        return out[:, :, 0] if one else out
    state = conv_state if conv_state_indices is None else conv_state[conv_state_indices.long()]   # (B, D, L)
    if cache_seqlens is not None:   # the ring buffer in time order, oldest first
        order = (torch.arange(L)[None, :] + (cache_seqlens.long() % L)[:, None]) % L               # (B, L)
        state = torch.gather(state, 2, order[:, None, :].expand(Bsz, Dd, L))
    xp = torch.cat([cast(state, weight.dtype), cast(x3, weight.dtype)], dim=-1)                   # (B, D, L + T)
    out = _taps(xp[:, :, L - (K - 1):], weight, bias, T, 2)   # (B, D, T): conv1d took 270 µs a token at D = 2048
    new = xp[:, :, T:]                                                                          # (B, D, L), oldest first
    if cache_seqlens is not None:   # back into ring order: the oldest now at (cache_seqlens + T) % L
        start = (cache_seqlens.long() + T) % L
        order = (torch.arange(L)[None, :] - start[:, None]) % L                                   # ring slot -> time
        new = torch.gather(new, 2, order[:, None, :].expand(Bsz, Dd, L))
    new = cast(new, conv_state.dtype)
    if conv_state_indices is None:
        conv_state.copy_(new)
    else:
        conv_state[conv_state_indices.long()] = new
    out = cast(_act(out, silu), x.dtype)
    return out[:, :, 0] if one else out
