"""The differential harness's problems (tests/attention/test_differential.py, tests/mpi_differential.py).

``make_case(seed, index, kind)`` draws one problem from ``np.random.default_rng([seed,
index, kind, world])``, so ``(seed, index, kind)`` is a complete reproduction. Kinds:
``"core"`` (qkv.attention and attention_backward: every option), ``"torch"`` (the same,
float32/float64), ``"ring"`` (the options ring attention takes, on a sequence that splits
over ``world`` ranks), and the layers ``"mha"``, ``"self"``, ``"ring_layer"``.

Softcap and dropout are drawn from a stream of their own (:func:`_softcap_dropout`). The
draw holds realistic magnitudes: score std 1 to 30 (put in q and k), ``scale`` up to 10
(and N(0, 1) inputs with ``scale`` up to 10 as they are), float64 biases of -1e30 and -1e38
beside float32 inputs (whole rows of them: uniform weights, not masked), rows that see
nothing (by mask, ``-inf`` bias, lengths, windows), NaN in every padding position
``kv_lengths``/``q_lengths`` say is never read, T = 1, odd sizes, Tq != Tk, MHA/GQA/MQA,
broadcast and 2-D/3-D inputs, negative scales, layer inputs of std up to 4, and a few
extreme options (``window=sys.maxsize``, ``2**63``, ``chunk=10**30``, ALiBi slopes of 1e39).
The first problems of a run (``PINNED``) are those that once gave wrong answers, so that
even a short run holds each of them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

KINDS = ("core", "torch", "ring", "mha", "self", "ring_layer")
TQ = [1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 40]
TK = [1, 2, 3, 4, 9, 16, 17, 31, 33, 48]


@dataclass
class Case:
    kind: str
    seed: int
    index: int
    arrays: dict                        # q, k, v, dout (attention); x, dy, context (layers)
    opts: dict                          # keyword options of the entry point
    tags: list = field(default_factory=list)
    refusable: str = ""                 # why a ShapeError is an acceptable answer ("" : it is not)
    extra: dict = field(default_factory=dict)   # layer constructor arguments, layout, method

    @property
    def dtype(self):
        first = self.arrays.get("q", self.arrays.get("x"))
        return first.dtype if self.kind not in ("mha", "self", "ring_layer") else np.dtype(self.extra["dtype"])

    def __str__(self):
        shapes = " ".join(f"{n}{tuple(a.shape)}" for n, a in self.arrays.items() if a is not None)
        opts = " ".join(f"{n}={describe(v)}" for n, v in self.opts.items())
        extra = " ".join(f"{n}={describe(v)}" for n, v in self.extra.items() if n != "dtype")
        tags = f" [{', '.join(self.tags)}]" if self.tags else ""
        return (f"{self.kind} case (seed={self.seed}, index={self.index}): {np.dtype(self.dtype).name} {shapes} "
                f"{opts} {extra}{tags}; reproduce with "
                f"`import problems; problems.make_case({self.seed}, {self.index}, {self.kind!r}"
                f"{', world=' + str(self.extra['world']) if 'world' in self.extra else ''})` (tests/ on sys.path)")


def describe(v) -> str:
    """An option's value, short: small arrays in full, others by dtype and shape."""
    if isinstance(v, np.ndarray):
        if v.size <= 4 and v.dtype.kind in "iuf":
            return f"np.array({v.tolist()}, {v.dtype.name})"
        if v.size and v.dtype.kind in "iuf" and (v == v.flat[0]).all():
            return f"np.full({tuple(v.shape)}, {v.flat[0]!r}, {v.dtype.name})"
        return f"<{v.dtype.name} {tuple(v.shape)}>"
    if isinstance(v, int) and abs(v) > 2 ** 31:
        if v == sys.maxsize:
            return "sys.maxsize"
        if v == 2 ** (v.bit_length() - 1):
            return f"2**{v.bit_length() - 1}"
        return f"10**{len(str(v)) - 1}" if v == 10 ** (len(str(v)) - 1) else str(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(describe(x) for x in v) + ")"
    if isinstance(v, float):
        return f"{v:.4g}"
    return repr(v)


# ----------------------------------------------------------------------------- drawing
def _logu(rng, lo, hi) -> float:
    return float(10 ** rng.uniform(np.log10(lo), np.log10(hi)))


def _magnitudes(rng, d, tags, allow_negative=True) -> tuple[float | None, float]:
    """(scale option or None, std of q and k): score std 1..30, or N(0,1) with scale up to 10."""
    pick = rng.random()
    if pick < 0.15:                                   # as they are, scale up to 10
        scale = float(rng.uniform(1, 10))
        tags.append(f"raw N(0,1) scale {scale:.3g}")
        return scale, 1.0
    sigma = _logu(rng, 1, 30)
    tags.append(f"score std {sigma:.3g}")
    if pick < 0.55:
        return None, float(np.sqrt(sigma))
    scale = _logu(rng, 0.1, 10) * (-1 if allow_negative and rng.random() < 0.05 else 1)
    return scale, float(np.sqrt(sigma / (abs(scale) * np.sqrt(d))))


def _causal(rng, opts) -> None:
    pick = rng.random()
    if pick < 0.4:
        if rng.random() < 0.2:
            opts["align"] = "bottom_right"
        return
    opts["causal"] = [True, "top_left", "bottom_right", True][int(rng.integers(4))]
    if opts["causal"] is True and rng.random() < 0.4:
        opts["align"] = "bottom_right"


def _is_causal(opts) -> bool:
    return bool(opts.get("causal"))


def _window(rng, opts) -> None:
    if rng.random() < 0.5:
        opts["window"] = int(rng.integers(0, 10))
        return
    left = None if rng.random() < 0.25 else int(rng.integers(0, 10))
    if _is_causal(opts):
        right = None if rng.random() < 0.3 else 0
    else:
        right = None if rng.random() < 0.25 else int(rng.integers(0, 10))
    opts["window"] = (left, right)


EXTREMES = ("window_maxsize_right", "window_maxsize_left", "window_maxsize", "window_2**63", "chunk_10**30",
            "chunk_maxsize", "alibi_1e39")


def _extreme(rng, opts, case_dtype, hq, has_heads, tags, pick=None) -> str:
    """One option at the edge of the integers or of float32; returns why a refusal is fine ("" if not)."""
    if pick is None:
        picks = EXTREMES if has_heads else EXTREMES[:-1]
        pick = picks[int(rng.integers(len(picks)))]
    tags.append(pick)
    opts.pop("window", None)
    if pick == "window_maxsize_right":
        opts.pop("causal", None)
        opts["window"] = (None, sys.maxsize)
    elif pick == "window_maxsize_left":
        opts["window"] = (sys.maxsize, None if _is_causal(opts) or rng.random() < 0.5 else 3)
    elif pick == "window_maxsize":
        opts["window"] = sys.maxsize
    elif pick == "window_2**63":
        opts["window"] = 2 ** 63 if rng.random() < 0.5 or _is_causal(opts) else (2 ** 63, 2 ** 64)
        return "a window side past int64"
    elif pick == "chunk_10**30":
        opts["chunk"] = 10 ** 30
        return "a chunk past int64"
    elif pick == "chunk_maxsize":
        opts["chunk"] = sys.maxsize
    else:
        opts["alibi"] = np.full(hq, 1e39)
        if case_dtype != np.float64:
            return "ALiBi slopes past float32's range, on float32 compute"
    return ""


def _nan_padding(x, lengths, axis_batch_full: bool) -> None:
    """NaN into the positions past each length along axis -2 (x's first axis is the batch
    when ``axis_batch_full``, else x is shared by all batch items: past the longest)."""
    if x.ndim == 2 or not axis_batch_full:
        x[..., int(np.max(lengths)):, :] = np.nan
        return
    for b, n in enumerate(lengths):
        x[b, ..., int(n):, :] = np.nan


def _shapes(rng, kind, world):
    """(q shape, k shape, v shape, gqa, lead): a layout of heads and leading axes."""
    d = int(rng.choice([1, 2, 3, 8, 16, 19, 32]))
    dv = int(rng.choice([1, 5, d, d]))
    if kind == "ring":
        t = 2 * world * int(rng.choice([1, 2, 3, 4, 6]))
        tq = tk = t
        d = int(rng.choice([2, 8, 16])) if d == 1 else d
    else:
        tq = int(rng.choice(TQ))
        tk = tq if rng.random() < 0.3 else int(rng.choice(TK))
    b = int(rng.integers(1, 4))
    pick = rng.random()
    if kind == "ring" or pick < 0.45:                    # 4-D, MHA / GQA / MQA with gqa=True
        hkv = int(rng.integers(1, 3))
        hq = hkv * int(rng.choice([1, 2, 3]))
        gqa = hq != hkv or rng.random() < 0.5
        if not gqa:
            hkv = hq
        return (b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, dv), gqa, (b, hq)
    if pick < 0.65:                                      # 4-D, k/v broadcast over batch or heads
        hq = int(rng.integers(1, 4))
        kb, kh = (1 if rng.random() < 0.5 else b), (1 if rng.random() < 0.3 else hq)
        return (b, hq, tq, d), (kb, kh, tk, d), (kb, kh, tk, dv), False, (b, hq)
    if pick < 0.8:                                       # 3-D (H, T, D)
        h = int(rng.integers(1, 4))
        kh = 1 if rng.random() < 0.3 else h
        return (h, tq, d), (kh, tk, d), (kh, tk, dv), False, (h,)
    return (tq, d), (tk, d), (tk, dv), False, ()         # 2-D: one sequence


def _bias(rng, lead, tq, tk, sigma, dtype, tags, row_value=None):
    """A bias broadcasting to lead + (Tq, Tk), with HF's mask values and whole rows of them
    (``row_value``: a float64 bias with one whole row of it)."""
    shape = tuple(n if rng.random() < 0.6 else 1 for n in lead) + (tq, tk)
    if rng.random() < 0.2 and shape[:-2]:
        shape = shape[1:]
    bdt = np.float64 if dtype == np.float64 else [np.float64, np.float32][int(rng.integers(2))]
    if row_value is not None:
        bdt = np.float64
    bias = rng.standard_normal(shape) * sigma * rng.uniform(0, 1)
    bias[rng.random(shape) < 0.1] = -1e30
    bias[rng.random(shape) < 0.05] = -1e38
    bias[rng.random(shape) < 0.05] = -np.inf
    row = (Ellipsis, int(rng.integers(tq)), slice(None))
    pick = rng.random()
    if row_value is not None:
        bias[row] = row_value
        tags.append(f"a bias row of {row_value:g}")
    elif pick < 0.4:
        bias[row] = -1e30
        tags.append("a bias row of -1e30")
    elif pick < 0.55:
        bias[row] = -1e38
        tags.append("a bias row of -1e38")
    elif pick < 0.7:
        bias[row] = -np.inf
        tags.append("a bias row of -inf")
    elif pick < 0.8 and bdt == np.float32:
        bias[row] = np.finfo(np.float32).min
        tags.append("a bias row of finfo(float32).min")
    if bdt == np.float64 and dtype != np.float64:
        tags.append(f"float64 bias beside {np.dtype(dtype).name} inputs")
    return bias.astype(bdt)


# The first problems of every run: what once gave a wrong answer, so a short run holds them
# all (the rest of each problem is drawn as usual).
PINNED = {
    "core": ("raw scale 8", "bias row -1e30", "bias row -1e38") + EXTREMES,
    "torch": ("raw scale 8", "bias row -1e30", "window_maxsize_right", "window_2**63", "alibi_1e39"),
    "ring": ("raw scale 8", "raw scale 8", "window_maxsize_right", "chunk_10**30", "alibi_1e39"),
}


def _softcap_dropout(rng, opts, tags) -> None:
    """softcap (1 to 60: Grok's 30 and Gemma 2's 50 inside) and dropout (p up to 0.9, a 64-bit
    seed), drawn from their own stream so that every older draw of a case stays as it was."""
    if rng.random() < 0.25:
        opts["softcap"] = _logu(rng, 1, 60)
        tags.append(f"softcap {opts['softcap']:.3g}")
    if rng.random() < 0.25:
        opts["dropout_p"] = float(rng.choice([0.1, 0.3, 0.9]))
        opts["dropout_seed"] = int(rng.integers(2 ** 63)) * (1 if rng.random() < 0.8 else -1)
        tags.append(f"dropout {opts['dropout_p']}")


def _attention_case(rng, seed, index, kind, world) -> Case:
    tags: list = []
    pins = PINNED.get(kind, ())
    pin = pins[index] if index < len(pins) else None
    if kind == "core":
        dtype = [np.float32] * 11 + [np.float64] * 7 + [np.float16] * 2
        dtype = dtype[int(rng.integers(len(dtype)))]
    else:
        dtype = np.float32 if rng.random() < 0.55 else np.float64
    if pin is not None:
        dtype = np.float32                                # float32 compute: where the bugs were
        tags.append(f"pinned: {pin}")
    qs, ks, vs, gqa, lead = _shapes(rng, kind, world)
    while pin is not None and len(lead) < 2:              # pinned problems: 4-D, heads for ALiBi
        qs, ks, vs, gqa, lead = _shapes(rng, kind, world)
    tq, d = qs[-2:]
    tk = ks[-2]
    opts: dict = {"gqa": True} if gqa else {}
    scale, std = _magnitudes(rng, d, tags)
    if pin == "raw scale 8":
        scale, std = 8.0, 1.0
        tags[-1] = "raw N(0,1) scale 8"
    if scale is not None:
        opts["scale"] = scale
    _causal(rng, opts)
    if rng.random() < 0.3:
        _window(rng, opts)
    if rng.random() < 0.15:
        opts["chunk"] = int(rng.integers(1, 13))
    batch = lead[0] if lead else 1
    if rng.random() < 0.3:
        opts["kv_lengths"] = rng.integers(0 if rng.random() < 0.7 else tk, tk + 1, size=batch)
    dense = kind != "ring"
    if dense and rng.random() < 0.2:
        opts["q_lengths"] = rng.integers(0, tq + 1, size=batch)
    if dense and rng.random() < 0.2:
        shape = tuple(n if rng.random() < 0.6 else 1 for n in lead) + (tq, tk)
        mask = rng.random(shape) < 0.8
        if rng.random() < 0.5:
            mask[..., int(rng.integers(tq)), :] = False
            tags.append("a masked row")
        opts["mask"] = mask
    if pin in ("bias row -1e30", "bias row -1e38"):       # the row is the bias's alone
        opts.pop("mask", None)
    if dense and (rng.random() < 0.3 or pin in ("bias row -1e30", "bias row -1e38")):
        row = None if pin is None or not pin.startswith("bias") else float(pin.split()[-1])
        opts["bias"] = _bias(rng, lead, tq, tk, std * std * np.sqrt(d), dtype, tags, row)
    if lead and rng.random() < 0.2:
        shape = (lead[-1],) if len(lead) == 1 or rng.random() < 0.6 else (lead[0], lead[-1])
        opts["alibi"] = rng.uniform(0, 1, shape) * (1.0 if rng.random() < 0.7 else 4.0)
    _softcap_dropout(np.random.default_rng([seed, index, KINDS.index(kind), world, 21]), opts, tags)
    refusable = ""
    if rng.random() < 0.06 or pin in EXTREMES:
        refusable = _extreme(rng, opts, dtype, lead[-1] if lead else 0, bool(lead), tags,
                             pin if pin in EXTREMES else None)
    q = rng.standard_normal(qs) * std
    k = rng.standard_normal(ks) * std
    v = rng.standard_normal(vs) * (1.0 if rng.random() < 0.7 else 4.0)
    dout = rng.standard_normal(lead + (tq, vs[-1]))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    if "kv_lengths" in opts:                          # never read: NaN there must not leak
        full = len(ks) > 2 and ks[0] == batch
        _nan_padding(k, opts["kv_lengths"], full)
        _nan_padding(v, opts["kv_lengths"], full)
        if (opts["kv_lengths"] == 0).any():
            tags.append("kv_lengths 0")
    if "q_lengths" in opts:
        _nan_padding(q, opts["q_lengths"], True)
        _nan_padding(dout, opts["q_lengths"], True)
    extra = {}
    if kind == "ring":
        extra = {"world": world, "layout": ["zigzag", "contiguous"][int(rng.integers(2))]}
    if kind == "torch":
        extra = {"method": ["reference", "flash", "auto"][int(rng.integers(3))]}
    return Case(kind, seed, index, dict(q=q, k=k, v=v, dout=dout), opts, tags, refusable, extra)


def _layer_case(rng, seed, index, kind, world) -> Case:
    tags: list = []
    dtype = np.float32 if rng.random() < 0.55 else np.float64
    b = int(rng.integers(1, 4))
    std = float(rng.uniform(1, 4))
    tags.append(f"x std {std:.3g}")
    if kind == "self":
        d_model, d_k = int(rng.choice([3, 8, 16])), int(rng.choice([2, 8, 16]))
        t = int(rng.choice(TQ))
        lead = [(), (b,), (b, 2)][int(rng.integers(3))]
        extra = dict(d_model=d_model, d_k=d_k, d_v=int(rng.choice([d_k, 5])), dtype=dtype,
                     causal=[False, True][int(rng.integers(2))], seed=int(rng.integers(2 ** 31)))
        x = rng.standard_normal(lead + (t, d_model)) * std
        dy = rng.standard_normal(lead + (t, extra["d_v"]))
        return Case(kind, seed, index, dict(x=x, dy=dy), {}, tags, "", extra)
    n_heads = int(rng.choice([1, 2, 4]))
    n_kv = int(rng.choice([h for h in (1, 2, 4) if n_heads % h == 0]))
    d_head = int(rng.choice([2, 4, 8]))
    d_model = int(rng.choice([8, 12, 16]))
    extra = dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head, dtype=dtype,
                 rope=bool(rng.random() < 0.4), alibi=bool(rng.random() < 0.3), bias=bool(rng.random() < 0.5),
                 seed=int(rng.integers(2 ** 31)))
    opts: dict = {}
    _causal(rng, opts)
    if rng.random() < 0.3:
        _window(rng, opts)
    if rng.random() < 0.15:
        opts["chunk"] = int(rng.integers(1, 9))
    if rng.random() < 0.2:
        opts["scale"] = _logu(rng, 0.3, 3)
    extra.update(opts)
    if kind == "ring_layer":
        t = tk = 2 * world * int(rng.choice([1, 2, 3]))
        extra.update(world=world, layout=["zigzag", "contiguous"][int(rng.integers(2))])
        cross = False
    else:
        t = int(rng.choice(TQ))
        cross = rng.random() < 0.25
        tk = int(rng.choice(TK)) if cross else t
    call: dict = {}
    if rng.random() < 0.25:
        call["kv_lengths"] = rng.integers(0 if rng.random() < 0.5 else tk, tk + 1, size=b)
    if kind == "mha" and rng.random() < 0.2:
        call["q_lengths"] = rng.integers(1, t + 1, size=b)
    squeeze = kind == "mha" and b == 1 and rng.random() < 0.4
    x = rng.standard_normal((b, t, d_model)) * std
    dy = rng.standard_normal((b, t, d_model))
    ctx = rng.standard_normal((b, tk, d_model)) * std if cross else None
    if squeeze:
        x, dy, ctx = x[0], dy[0], (None if ctx is None else ctx[0])
        tags.append("2-D input")
    return Case(kind, seed, index, dict(x=x, dy=dy, context=ctx), call, tags, "", extra)


def make_case(seed: int, index: int, kind: str = "core", world: int = 1) -> Case:
    """Problem ``index`` of the run seeded ``seed`` for entry points of ``kind``."""
    rng = np.random.default_rng([seed, index, KINDS.index(kind), world])
    if kind in ("mha", "self", "ring_layer"):
        return _layer_case(rng, seed, index, kind, world)
    return _attention_case(rng, seed, index, kind, world)


def cases(seed: int, n: int, kind: str = "core", world: int = 1):
    """``n`` problems of ``kind``: ``make_case(seed, i, kind)`` for i < n."""
    for i in range(n):
        yield make_case(seed, i, kind, world)
