"""The differential harness's judge, shared by tests/attention/test_differential.py and the MPI worker
tests/mpi_differential.py (the problems are tests/problems.py, the oracle tests/oracle.py).

For every result, against the float64 oracle on the same inputs (DESIGN.md, "Numerics
policy"):

- the same shape and dtype; no NaN; finite exactly where the oracle is (lse ``-inf``
  exactly for the rows that see nothing);
- float64 paths: ``‖err‖ <= 1e-10 · ‖size‖``, ``size`` being the oracle's ``Σ|terms|``;
- float32/float16 paths: ``‖err‖ <= 2 · max(‖err of plain float32‖, 4·eps·‖size‖)``: at most
  twice the error of the plain float32 dense computation (the oracle's own code run in
  float32, results rounded to the output dtype) on the same inputs, with a floor of 4 ulps of
  the result's size (below it an error is rounding of the result, and a ratio of two such
  errors measures luck). Norms over whole arrays, as tests/attention/test_adversarial.py measures.

The layers are judged the same way, their sizes carried through each product from the
attention's own. An option that does not fit the compute dtype (a window or chunk past
int64, an ALiBi slope past float32's range on float32 input) may instead be refused with
``qkv.ShapeError``; any other exception, a NaN or a RuntimeWarning is a failure (the
callers catch those).
"""
from __future__ import annotations

import warnings

import numpy as np

import qkv

import oracle
from problems import Case, cases, make_case  # noqa: F401  (one import for the callers)

FLOOR_ULPS = 4
BUDGET = 2.0
TOL64 = 1e-10


# ----------------------------------------------------------------------------- judging
def _norm(x) -> float:
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.sum(x * x)))


def error(got, want) -> float:
    """‖got - want‖ over the entries where want is finite (where it is not: checked apart)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(fin, got - np.where(fin, want, 0), 0)
    return _norm(diff)


def judge(name: str, got, want, size, base=None, dtype=None) -> str | None:
    """None if ``got`` is within the budget (module docstring) of the oracle's ``want``, else why not.

    ``size`` is the oracle's Σ|terms| (or None: the size of want); ``base`` the plain float32
    result (None: a float64 path); ``dtype`` the dtype ``got`` must have."""
    if got is None:
        return f"{name}: missing"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, expected {want.shape}"
    if dtype is not None and got.dtype != np.dtype(dtype):
        return f"{name}: dtype {got.dtype}, expected {np.dtype(dtype)}"
    if np.isnan(got).any():
        return f"{name}: {int(np.isnan(got).sum())} NaN of {got.size}"
    bad = np.isfinite(got) != np.isfinite(want)
    if bad.any():
        where = tuple(int(i[0]) for i in np.nonzero(bad))
        return (f"{name}: finite where the oracle is not, or the reverse, at {int(bad.sum())} entries, "
                f"first {where}: got {got[where]!r}, expected {want[where]!r}")
    neg = np.isneginf(want)
    if (got[neg] != -np.inf).any():
        return f"{name}: not -inf where the oracle is"
    size = np.abs(want) if size is None else size
    err, big = error(got, want), _norm(size)
    if base is None or got.dtype == np.float64:
        tol = TOL64 * big
        if err <= tol or err == 0:
            return None
        return f"{name}: float64 error {err:.3g} > {TOL64:g} x size {big:.3g}"
    floor = FLOOR_ULPS * float(np.finfo(got.dtype).eps) * big
    e_base = error(base, want)
    if err <= BUDGET * max(e_base, floor):
        return None
    fin = np.isfinite(want)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(fin, got.astype(np.float64) - np.where(fin, want, 0), 0)
    worst = np.unravel_index(np.argmax(np.abs(diff)), want.shape)
    return (f"{name}: error {err:.3g} > {BUDGET:g} x max(plain float32 error {e_base:.3g}, floor {floor:.3g}) "
            f"(worst at {tuple(int(i) for i in worst)}: got {got[worst]!r}, expected {want[worst]!r})")


def plain(sol: oracle.Solution, out_dtype) -> oracle.Solution:
    """The float32 solution's results rounded to the output dtype (lse stays float32)."""
    cast = (lambda x: None if x is None else x.astype(out_dtype))
    return oracle.Solution(cast(sol.out), sol.lse, cast(sol.weights), cast(sol.dq), cast(sol.dk), cast(sol.dv))


# ----------------------------------------------------------------------------- layers
LAYER_OPTIONS = ("causal", "align", "window", "chunk", "scale")


def judge_mha(case: Case, got: dict, params: dict) -> list:
    """Failures of a MultiHeadAttention-like layer's results against the oracle."""
    want = mha_oracle(case, params)
    base = mha_oracle(case, params, np.float32) if np.dtype(case.extra["dtype"]) != np.float64 else None
    return judge_layer(got, want, base, case.extra["dtype"])


def build_mha(case: Case, cls):
    """``cls`` (qkv.nn.MultiHeadAttention or the ring layer) as the case says, its biases
    made non-zero (they start at 0), and any extra constructor keywords of ``cls``."""
    e = case.extra
    kw = {name: e[name] for name in LAYER_OPTIONS if name in e}
    if "layout" in e:
        kw["layout"] = e["layout"]
    layer = cls(e["d_model"], e["n_heads"], n_kv_heads=e["n_kv_heads"], d_head=e["d_head"], rope=e["rope"],
                alibi=e["alibi"], bias=e["bias"], dtype=e["dtype"], rng=np.random.default_rng(e["seed"]), **kw)
    fill = np.random.default_rng(e["seed"] + 1)
    for name in layer.params:
        if name.startswith("b_"):
            layer.params[name][...] = fill.standard_normal(layer.params[name].shape) * 0.5
    return layer


def mha_oracle(case: Case, params: dict, dtype=np.float64) -> oracle.LayerSolution:
    """The oracle for an ``"mha"``/``"ring_layer"`` case, on the layer's parameters and the
    inputs rounded to the layer's dtype, 3-D or 2-D as given."""
    e, a = case.extra, case.arrays
    ldt = np.dtype(e["dtype"])
    squeeze = a["x"].ndim == 2

    def as3(x):
        return None if x is None else (x[None] if squeeze else x).astype(ldt)

    opts = {name: e[name] for name in LAYER_OPTIONS if name in e}
    sol = oracle.mha(params, as3(a["x"]), as3(a["dy"]), n_heads=e["n_heads"], n_kv_heads=e["n_kv_heads"],
                     context=as3(a.get("context")), rope_on=e["rope"], alibi=e["alibi"], dtype=dtype,
                     **opts, **case.opts)
    if squeeze:
        sol.y, sol.dx = sol.y[0], sol.dx[0]
        sol.dcontext = None if sol.dcontext is None else sol.dcontext[0]
        sol.size = {n: (s[0] if n in ("y", "dx", "dcontext") else s) for n, s in sol.size.items()}
    return sol


def judge_layer(got: dict, want: oracle.LayerSolution, base: oracle.LayerSolution | None, dtype) -> list:
    """Failures of a layer's results ``got`` (y, dx, dcontext, and ``d<param>`` for each
    parameter) against the oracle's ``want`` and the plain float32 chain ``base``."""
    fails = []
    expected = {"y": want.y, "dx": want.dx, "dcontext": want.dcontext,
                **{f"d{n}": g for n, g in want.grads.items()}}
    plain32 = {} if base is None else {"y": base.y, "dx": base.dx, "dcontext": base.dcontext,
                                       **{f"d{n}": g for n, g in base.grads.items()}}
    for name, w in expected.items():
        if w is None:
            if got.get(name) is not None:
                fails.append(f"{name}: not expected")
            continue
        fails.append(judge(name, got.get(name), w, want.size[name], plain32.get(name), dtype))
    return [f for f in fails if f]


def attempt(case, what: str, fn, fails: list, where: str = ""):
    """``(fn(), ok)``: an exception, or a RuntimeWarning (NumPy's overflow, invalid value...),
    is a failure; a ShapeError is fine for a case whose options may be refused."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = fn()
        except qkv.ShapeError as err:
            if not case.refusable:
                fails.append(f"{what}: raised ShapeError: {err}")
            return None, False
        except Exception as err:  # noqa: BLE001 - any other exception is what we look for
            fails.append(f"{what}: raised {type(err).__name__}: {err}")
            return None, False
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    if warned:
        fails.append(f"{what}{where}: RuntimeWarning: {warned[0].message}")
    return res, True


# ----------------------------------------------------------------------------- every kernel
KERNEL_MASKS = (dict(), dict(causal=True), dict(causal="bottom_right"), dict(window=(3, 2)), dict(window=(4, 0)),
                dict(causal=True, chunk=5), dict(softcap=30.0), dict(dropout_p=0.3, dropout_seed=11))


def every_kernel(spec, dtype) -> dict:
    """``{name: kernel}`` of every kernel that runs a problem of ``spec`` in compute ``dtype``:
    the registered ones (``method=``) and ``method="auto"``'s own choices (the stacked dense
    kernel, the row kernel with the fast extra, its NumPy form), where each applies."""
    from qkv import api, kernels
    from qkv.kernels import stacked
    from qkv.kernels.rows import kernel as rows, numpy_rows as rows_numpy

    found = {name: kernels.lookup(name) for name in kernels.names()}
    if stacked.applies(spec):
        found["stacked"] = api.STACKED
    if rows.applies(spec, dtype):
        found["rows"] = api.ROWS
    if rows_numpy.applies(spec, dtype):
        found["rows-numpy"] = api.ROWS_NUMPY
    return found


def run_kernel(kern, prob, dout, dlse, saved=None):
    """``(out, lse, dq, dk, dv)`` of one kernel on a prepared problem (``qkv.api.prepare``),
    through the kernel interface (:mod:`qkv.kernels.reference`), in the compute dtype; the
    backward from ``saved = (out, lse)`` where given (another kernel's forward)."""
    out, lse, _ = kern.forward(prob.q, prob.k, prob.v, prob.spec, prob.scale, prob.group)
    if saved is not None:
        out, lse = saved
    dt = prob.q.dtype
    extra = {} if dlse is None else {"dlse": dlse.astype(dt)}
    grads = kern.backward(dout.astype(dt), prob.q, prob.k, prob.v, out, lse, prob.spec, prob.scale, prob.group,
                          **extra)
    return (out, lse) + tuple(grads)


def judge_kernels(q, k, v, dout, dlse=None, lse_from=None, **opts) -> list:
    """Every kernel that takes the problem (:func:`every_kernel`), forward and backward (with
    ``dlse``), against the float64 oracle on the same float32 inputs, within the float32
    budget (the plain float32 dense error): the failures, each naming its kernel. With
    ``lse_from`` (a kernel's name) every backward starts from that kernel's out and lse
    (what ``method="auto"`` does where the forward asked for weights and the backward not),
    and the gradients must be finite where the oracle's are (at scores of 1e5 two kernels'
    roundings of S already differ by 1e-2, more than the budget of one kernel alone)."""
    from qkv import api

    want = oracle.solve(q, k, v, dout, dlse=dlse, **opts)
    base = plain(oracle.solve(q, k, v, dout, dlse=dlse, dtype=np.float32, **opts), np.float32)
    prob = api.prepare(q, k, v, **opts)
    found = every_kernel(prob.spec, prob.q.dtype)
    saved = None
    if lse_from is not None:
        saved = found[lse_from].forward(prob.q, prob.k, prob.v, prob.spec, prob.scale, prob.group)[:2]
    fails: list = []
    for name, kern in found.items():
        case = type("case", (), {"refusable": ""})
        res, ok = attempt(case, f"kernel {name!r}", lambda: run_kernel(kern, prob, dout, dlse, saved), fails)
        if not ok:
            continue
        for what, got in zip(("out", "lse", "dq", "dk", "dv"), res):
            w = getattr(want, what)
            if saved is not None and what in ("dq", "dk", "dv"):   # two kernels' roundings of S: finite is the bar
                if np.isnan(got).any() or (np.isfinite(got) != np.isfinite(w)).any():
                    fails.append(f"{name} {what}: {int(np.isnan(got).sum())} NaN, finite where the oracle is not or "
                                 f"the reverse at {int((np.isfinite(got) != np.isfinite(w)).sum())} entries")
                continue
            fails.append(judge(f"{name} {what}", got, w, want.size[what], getattr(base, what), np.float32))
    return [f for f in fails if f]


def one_hot_row(magnitude: float):
    """One query row whose scores are ``[-0.86, 0.8, 0.86, 0.1, 0.16, -0.05, 1.0] · magnitude``
    on seven keys (``q = s``, ``k = sqrt(D) · I``, ``v = I``, D = 8): past ~1e3 the weights are
    one-hot on the last key, ``out = v[6]`` and ``lse = magnitude`` (issue 34's reproduction)."""
    d = 8
    s = np.array([-0.86, 0.8, 0.86, 0.1, 0.16, -0.05, 1.0], np.float32) * np.float32(magnitude)
    q = np.zeros((1, 1, 1, d), np.float32)
    q[0, 0, 0, :7] = s
    k = (np.eye(7, d) * np.sqrt(d)).astype(np.float32)[None, None]
    v = np.eye(7, d, dtype=np.float32)[None, None]
    dout = np.arange(1, d + 1, dtype=np.float32).reshape(1, 1, 1, d)
    return q, k, v, dout


def extreme_problem(seed: int, index: int) -> tuple:
    """``(q, k, v, dout, dlse, opts, description)``: float32 scores of std 1e3 to 1e30 (every
    fifth problem the one-hot row of issue 34 at 1e3 to 1e30, exact), MHA or GQA, one of
    :data:`KERNEL_MASKS`; from ``np.random.default_rng([seed, index, 34])``."""
    rng = np.random.default_rng([seed, index, 34])
    mag = float(10 ** rng.uniform(3, 30))
    opts = dict(KERNEL_MASKS[int(rng.integers(len(KERNEL_MASKS)))])
    if index % 5 == 0:
        q, k, v, _ = one_hot_row(mag)
        opts = {}
        what = f"one-hot row at {mag:.3g}"
    else:
        b, hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2]))
        tq, tk, d = int(rng.choice([1, 7, 33])), int(rng.choice([5, 17, 40])), int(rng.choice([4, 16]))
        if opts.get("causal") is True or "chunk" in opts:
            tk = tq = max(tq, 2)
        if g > 1:
            opts["gqa"] = True
        q = (rng.standard_normal((b, hkv * g, tq, d)) * np.sqrt(mag)).astype(np.float32)
        k = (rng.standard_normal((b, hkv, tk, d)) * np.sqrt(mag)).astype(np.float32)
        v = rng.standard_normal((b, hkv, tk, d)).astype(np.float32)
        what = f"scores of std {mag:.3g}"
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(np.float32)
    dlse = rng.standard_normal(q.shape[:-1]).astype(np.float32) if rng.random() < 0.5 else None
    return q, k, v, dout, dlse, opts, f"{what}, q{q.shape} k{k.shape} {opts} dlse={dlse is not None}"


# ----------------------------------------------------------------------------- hidden keys
HIDING = (dict(causal=True), dict(causal="bottom_right"), dict(window=(2, 1)), dict(window=(3, 0)),
          dict(causal=True, chunk=4), dict(chunk=5, align="bottom_right"), dict(mask="random"),
          dict(bias="-inf"), dict(causal=True, softcap=20.0), dict(causal=True, dropout_p=0.3, dropout_seed=3))


def hidden_key_problem(seed: int, index: int) -> tuple:
    """``(q, k, v, dout, dlse, opts, (array, b, h, j, d, value), description)``: a float32 problem
    whose ``k`` or ``v`` holds a NaN or an inf at one entry ``[b, h, j, d]`` of a key ``j``
    that some rows may not see (a :data:`HIDING` rule) and others may; from
    ``np.random.default_rng([seed, index, 4])``."""
    rng = np.random.default_rng([seed, index, 4])
    b, hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    tq = tk = int(rng.choice([9, 17, 40, 70]))
    d = int(rng.choice([4, 16]))
    opts = dict(HIDING[index % len(HIDING)])
    lead = (b, hkv * g)
    if opts.get("mask") == "random":
        opts["mask"] = rng.random(lead + (tq, tk)) < 0.6
    if opts.get("bias") == "-inf":
        opts["bias"] = np.where(rng.random(lead + (tq, tk)) < 0.3, -np.inf, rng.standard_normal(lead + (tq, tk)))
    if g > 1:
        opts["gqa"] = True
    q = rng.standard_normal(lead + (tq, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, tk, d)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(lead + (tq, d)).astype(np.float32)
    dlse = rng.standard_normal(lead + (tq,)).astype(np.float32) if rng.random() < 0.5 else None
    seen = _seen(opts, lead, tq, tk)
    jb, jh = int(rng.integers(b)), int(rng.integers(hkv))
    heads = seen[jb, jh * g:(jh + 1) * g]                                  # (G, Tq, Tk)
    partly = [j for j in range(tk) if heads[..., j].any() and not heads[..., j].all()]
    j = int(rng.choice(partly)) if partly else int(rng.integers(tk))
    poison = ("k" if index % 2 else "v", jb, jh, j, int(rng.integers(d)), [np.nan, np.inf, -np.inf][index % 3])
    (k if poison[0] == "k" else v)[poison[1:5]] = poison[5]
    shown = {n: (x if not isinstance(x, np.ndarray) else f"<{x.dtype.name} {x.shape}>") for n, x in opts.items()}
    return q, k, v, dout, dlse, opts, poison, f"{poison[0]}{list(poison[1:5])} = {poison[5]}, q{q.shape} {shown}"


def _seen(opts, lead, tq, tk) -> np.ndarray:
    """``(*lead, Tq, Tk)``: which keys each row may see (the oracle's rules; a -inf bias hides)."""
    rules = {n: opts[n] for n in ("causal", "align", "window", "chunk", "mask") if n in opts}
    seen = oracle.allowed(lead, tq, tk, **rules)
    if "bias" in opts:
        seen &= np.broadcast_to(opts["bias"] != -np.inf, seen.shape)
    return seen


def judge_hidden(q, k, v, dout, dlse, opts, poison) -> list:
    """Every kernel on a problem with one non-finite entry of k or v (:func:`hidden_key_problem`):
    non-finite exactly where a row that may see the entry puts it (``out[i, d]`` for a bad
    ``v[j, d]``; the row's out and lse for a bad ``k_j``; then dq of such rows, dk of the keys
    they see, dv of the keys a bad-k row sees), and elsewhere the oracle's answer on the
    problem with that entry 0 (the key is hidden from every other row), within the float32 budget."""
    from qkv import api

    which, b, h, j, d, _ = poison
    clean_k, clean_v = k.copy(), v.copy()
    (clean_k if which == "k" else clean_v)[b, h, j, d] = 0
    want = oracle.solve(q, clean_k, clean_v, dout, dlse=dlse, **opts)
    base = plain(oracle.solve(q, clean_k, clean_v, dout, dlse=dlse, dtype=np.float32, **opts), np.float32)
    lead, tq, tk = q.shape[:-2], q.shape[-2], k.shape[-2]
    g = q.shape[1] // k.shape[1]
    seen = _seen(opts, lead, tq, tk)
    rows = np.zeros(lead + (tq,), bool)
    rows[b, h * g:(h + 1) * g] = seen[b, h * g:(h + 1) * g, :, j]        # the rows that see the bad entry
    keys = (seen & rows[..., None]).reshape(lead[0], k.shape[1], g, tq, tk).any(axis=(2, 3))   # the keys they see
    bad = {"out": np.zeros(want.out.shape, bool), "lse": np.zeros(want.lse.shape, bool),
           "dq": np.broadcast_to(rows[..., None], want.dq.shape), "dk": np.broadcast_to(keys[..., None], want.dk.shape),
           "dv": np.zeros(want.dv.shape, bool)}
    if which == "v":
        bad["out"][..., d] = rows
    else:
        bad["out"][...] = rows[..., None]
        bad["lse"] = rows
        bad["dv"] = bad["dk"]
    prob = api.prepare(q, k, v, **opts)
    fails: list = []
    for name, kern in every_kernel(prob.spec, prob.q.dtype).items():
        case = type("case", (), {"refusable": ""})
        res, ok = attempt(case, f"kernel {name!r}", lambda: run_kernel(kern, prob, dout, dlse), fails)
        if not ok:
            continue
        for what, got in zip(("out", "lse", "dq", "dk", "dv"), res):
            w, nf = getattr(want, what), bad[what]
            if not np.array_equal(~np.isfinite(got), nf):
                wrong = np.argwhere(~np.isfinite(got) != nf)
                fails.append(f"{name} {what}: non-finite at {int((~np.isfinite(got)).sum())} entries, expected "
                             f"{int(nf.sum())} (those a row that sees the entry puts it); first wrong at "
                             f"{tuple(int(i) for i in wrong[0])}")
                continue
            fails.append(judge(f"{name} {what}", np.where(nf, w.astype(got.dtype), got), w, want.size[what],
                               getattr(base, what), np.float32))
    return [f for f in fails if f]
