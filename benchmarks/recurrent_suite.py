"""``qkv bench --suite recurrent``: the recurrences of :mod:`qkv.recurrent` against torch CPU
chunk forms, their growth in T, and decoding one token with a state against a KV cache.

Rows, float32, ``(B, H, T, D)`` with ``Dk = Dv = D``:

- ``decay`` (Mamba-2's SSD, one decay a head): ``qkv.recurrent.decay_attention`` (+ its
  backward) against flash-linear-attention's ``naive_chunk_simple_gla`` (a torch chunk
  form, chunk 64, loaded by path from the installed fla-core as the tests do: its package
  needs triton), backward by autograd. transformers' Mamba-2 chunk scan is not a
  standalone function (it lives inside ``Mamba2Mixer.torch_forward``), so the layer rows
  (:data:`LAYERS`: ``qkv.nn.Mamba2`` against ``Mamba2Mixer``, ``GatedDeltaNet`` against
  ``Qwen3NextGatedDeltaNet``, in :mod:`benchmarks.recurrent_layers`) are where it enters.
- ``gla`` (a decay a key channel): against fla's ``naive_recurrent_gla`` (fla has no torch
  chunk form of GLA; the peer is its step loop, so only short T).
- ``delta`` (Gated DeltaNet): ``qkv.recurrent.delta_rule`` against transformers'
  ``torch_chunk_gated_delta_rule`` (Qwen3-Next), k L2-normalised, scale ``D^-1/2`` both.
- ``growth``: ``decay`` forward at T = 2k ... 16k, every T timed once in each round;
  ``slope_qkv`` and ``slope_peer``: the median over rounds of the least-squares slope of log
  time against log T (1: linear).
- ``decode``: one token with a state, ``decay_attention`` at T = 1 from a ``(B, H, D, D)``
  state, against a softmax attention decode step ``qkv.attention`` over a KV cache of L
  keys: the first flat in L, the second linear.

Each row: ``kernel``, ``shape``, ``pass`` (fwd, fwd+bwd, decode), ``qkv_s``, ``peer_s``
(medians), ``ratio`` (median over repeats of peer ÷ qkv within a repeat: above 1, qkv is
faster), ``peer`` (what the peer is), and for ``decay`` ``products_s`` and ``bound``: the
chunked form's matrix products alone (:func:`decay_products`) in the kernel's chunks,
units and threads, and peer ÷ products: what the ratio would be if everything else cost
nothing and the products were made four a chunk (the one-panel kernel merges them into two). Timing: ``timing.rounds``, sides alternating, first side rotating.
"""
from __future__ import annotations

import importlib.util
import os
import statistics

from . import recurrent_products
from .timing import rounds

PASSES = ("fwd", "fwd+bwd")
FULL = {
    "decay": ((1, 8, 2048, 64), (1, 8, 4096, 128), (4, 16, 2048, 64)),
    "gla": ((1, 8, 1024, 64),),
    "delta": ((1, 8, 2048, 64), (1, 16, 4096, 128)),
    "growth": dict(b=1, h=8, d=64, ts=(2048, 4096, 8192, 16384)),
    "decode": dict(b=1, h=8, d=128, ls=(1024, 4096, 16384, 65536)),
}
QUICK = {
    "decay": ((1, 2, 256, 32),),
    "gla": ((1, 2, 64, 16),),
    "delta": ((1, 2, 64, 16),),
    "growth": dict(b=1, h=2, d=32, ts=(256, 512)),
    "decode": dict(b=1, h=2, d=32, ls=(256, 1024)),
}
KERNELS = ("decay", "gla", "delta")
# The layer rows (qkv.nn.Mamba2 against transformers' Mamba2Mixer, GatedDeltaNet against
# Qwen3NextGatedDeltaNet): benchmarks/recurrent_layers.py.
LAYERS = ("mamba2", "gated_delta")


def peer_missing() -> str | None:
    """Why the peers cannot run (torch, einops, fla-core or transformers missing), or None."""
    for module, extra in (("torch", "torch"), ("einops", "test"), ("fla", "test"), ("transformers", "hf")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[{extra}]')"
    return None


def _fla_naive(op: str):
    """fla-core's ``fla/ops/<op>/naive.py`` as a module, without the package (it needs triton)."""
    spec = importlib.util.find_spec("fla")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", op, "naive.py")
    mod_spec = importlib.util.spec_from_file_location(f"qkv_bench_fla_{op}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def cases(quick: bool, kernels=KERNELS) -> list[tuple[str, tuple, str]]:
    """``(kernel, shape, pass)`` of the kernel rows, in the order measured."""
    sizes = QUICK if quick else FULL
    return [(kern, s, p) for kern in kernels for s in sizes[kern] for p in PASSES]


def steps(quick: bool, kernels=KERNELS) -> int:
    """How many rows :func:`measure` makes (one progress step each)."""
    sizes = QUICK if quick else FULL
    return (len(cases(quick, kernels)) + len(sizes["growth"]["ts"]) + len(sizes["decode"]["ls"])
            + 2 * len(LAYERS))


def _inputs(rng, kern, shape):
    """float32 numpy arrays of one case: ``q, k, v, dout`` and the kernel's own parameters."""
    import numpy as np
    b, h, t, d = shape
    q, k, v, dout = (rng.standard_normal((b, h, t, d), dtype=np.float32) for _ in range(4))
    if kern == "gla":
        return q, k, v, dout, [np.log(rng.uniform(0.9, 1.0, (b, h, t, d))).astype(np.float32)]
    g = np.log(rng.uniform(0.9, 1.0, (b, h, t))).astype(np.float32)
    if kern == "decay":
        return q, k, v, dout, [g]
    k /= np.linalg.norm(k, axis=-1, keepdims=True)                      # the delta rule's keys are unit
    beta = rng.uniform(0.1, 0.9, (b, h, t)).astype(np.float32)
    return q, k, v, dout, [beta, g]


def _qkv_side(kern, q, k, v, dout, params, backward):
    import qkv.recurrent as rec
    fwd, bwd = {"decay": (rec.decay_attention, rec.decay_attention_backward),
                "gla": (rec.decay_attention, rec.decay_attention_backward),
                "delta": (rec.delta_rule, rec.delta_rule_backward)}[kern]

    def run():
        out = fwd(q, k, v, *params)
        return bwd(dout, q, k, v, *params) if backward else out
    return run


def _peer_side(kern, q, k, v, dout, params, backward):
    """The torch peer on (B, T, H, ·) copies of the inputs (made once, outside the timing)."""
    import numpy as np
    import torch
    bthd = lambda x: torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))  # noqa: E731
    xs = [bthd(x) for x in (q, k, v)] + [bthd(p) for p in params]
    do = bthd(dout)
    if kern == "decay":
        chunked = _fla_naive("simple_gla").naive_chunk_simple_gla
        fn = lambda q, k, v, g: chunked(q, k, v, g)[0]  # noqa: E731
    elif kern == "gla":
        stepped = _fla_naive("gla").naive_recurrent_gla
        fn = lambda q, k, v, g: stepped(q, k, v, g)[0]  # noqa: E731
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        fn = lambda q, k, v, beta, g: torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]  # noqa: E731
    if not backward:
        def run():
            with torch.no_grad():
                return fn(*xs)
        return run
    leaves = [x.clone().requires_grad_() for x in xs]

    def run_bwd():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(do)
    return run_bwd


def decay_products(q, k, v, dout, backward: bool, chunk: int | None = None):
    """A no-argument callable running only the matrix products of the chunked decay form
    (one decay a head), in the kernel's chunks, work units and threads, BLAS held to one
    thread: forward ``U = Kgᵀ V``, ``Q S``, ``Q Kᵀ``, ``A V`` (in the forward's value panels;
    float32: chunk after chunk from a compiled loop as the kernel runs them, :mod:`.recurrent_products`);
    backward adds ``U``, ``Qgᵀ dO``, ``dO Sᵀ``, ``V dSᵀ``, ``Kg dS``, ``Q Kᵀ``, ``Aᵀ dO``, ``dO Vᵀ``, ``dA K``,
    ``dAᵀ Q``. The results are garbage; only the time counts."""
    import numpy as np

    from qkv.recurrent.decay import chunk as decay

    B, H, T, D = q.shape
    C = decay._chunk_size(chunk, T, D)
    Nc = -(-T // C)
    flat = lambda x: decay._split(x.reshape(B * H, T, -1), C)  # noqa: E731  (N,Nc,C,D)
    qf, kf, vf, df = flat(q), flat(k), flat(v), flat(dout)
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    kTf = np.ascontiguousarray(t(kf))                    # the kernel's KgT: Kgᵀ stored (n,Nc,D,C)
    p = decay._panels(D)                                 # the forward's value panels (n,Nc,p,C,D/p)
    vpf = np.ascontiguousarray(vf.reshape(vf.shape[:3] + (p, D // p)).swapaxes(2, 3))
    compiled = recurrent_products.loop() if q.dtype == np.float32 and min(C, D // p) > 1 else None
    states = np.zeros((B * H, p, D, D // p), q.dtype)

    def unit(a, b):
        qa, ka, kTa, va, da = qf[a:b], kf[a:b], kTf[a:b], vf[a:b], df[a:b]
        if compiled is not None:                         # as the kernel's compiled forward runs them
            compiled(qa, kTa, va, states[a:b])
        else:
            S = kTa[:, :, None] @ vpf[a:b]               # (n,Nc,1,D,C) @ (n,Nc,p,C,w): the states' U
            o = qa[:, :, None] @ S                       # q S
            A = qa @ kTa                                 # (n,Nc,C,C)
            o += A[:, :, None] @ vpf[a:b]
        if backward:
            S = kTa @ va
            dS = t(qa) @ da                              # R = Qgᵀ dO'
            dq, dk, dv = da @ t(S), va @ t(dS), ka @ dS
            A = qa @ kTa
            dv += t(A) @ da
            dA = da @ t(va)
            dq += dA @ ka
            dk += t(dA) @ qa

    def run():
        decay._run(B * H, Nc * C, C, unit)
    return run


def _timed(fns, repeats):
    runs = rounds(fns, repeats, rotate=True)
    walls = {m: [w for w, _ in r] for m, r in runs.items()}
    secs = {m: statistics.median(w) for m, w in walls.items()}
    per = lambda m: statistics.median(a / b for a, b in zip(walls["peer"], walls[m]))  # noqa: E731
    return secs, per


PEERS = {"decay": "fla naive_chunk_simple_gla (torch)", "gla": "fla naive_recurrent_gla (torch)",
         "delta": "transformers torch_chunk_gated_delta_rule", "decode": "qkv.attention over a KV cache"}


def _kernel_row(rng, kern, shape, pass_, repeats, group="kernel"):
    q, k, v, dout, params = _inputs(rng, kern, shape)
    backward = pass_ == "fwd+bwd"
    fns = {"qkv": _qkv_side(kern, q, k, v, dout, params, backward),
           "peer": _peer_side(kern, q, k, v, dout, params, backward)}
    if kern == "decay":
        fns["products"] = decay_products(q, k, v, dout, backward)
    secs, per = _timed(fns, repeats)
    return dict(kernel=kern, group=group, shape=list(shape), **{"pass": pass_}, qkv_s=secs["qkv"],
                peer_s=secs["peer"], ratio=per("qkv"), peer=PEERS[kern], products_s=secs.get("products"),
                bound=per("products") if "products" in secs else None)


def _decode_row(rng, c, L, repeats):
    """One token: the recurrence's step from a state against softmax attention over L cached keys."""
    import numpy as np

    import qkv
    import qkv.recurrent as rec
    b, h, d = c["b"], c["h"], c["d"]
    q, k, v = (rng.standard_normal((b, h, 1, d), dtype=np.float32) for _ in range(3))
    g = np.full((b, h, 1), -0.05, np.float32)
    state = rng.standard_normal((b, h, d, d), dtype=np.float32)
    K, V = (rng.standard_normal((b, h, L, d), dtype=np.float32) for _ in range(2))
    fns = {"qkv": lambda: rec.decay_attention(q, k, v, g, initial_state=state, return_state=True),
           "peer": lambda: qkv.attention(q, K, V)}
    secs, per = _timed(fns, repeats)
    return dict(kernel="decode", group="decode", shape=[b, h, L, d], **{"pass": "decode"}, qkv_s=secs["qkv"],
                peer_s=secs["peer"], ratio=per("qkv"), peer=PEERS["decode"], products_s=None, bound=None)


def _slope(ts, secs) -> float:
    """Least-squares slope of log(seconds) against log(T)."""
    import numpy as np
    return float(np.polyfit(np.log(ts), np.log(secs), 1)[0])


def _growth_rows(rng, gr, repeats, say):
    """The ``decay`` forward at every T of ``gr``, measured together: each round times every
    T once on each side, in rotating order, so a host whose speed drifts over the minutes a
    row takes moves all T alike. ``slope_qkv``, ``slope_peer``: the median over rounds of the
    slope of that round's times (the rows' seconds and ratios are medians as elsewhere)."""
    fns, shapes = {}, {}
    for t in gr["ts"]:
        say(f"growth T={t}")
        shapes[t] = (gr["b"], gr["h"], t, gr["d"])
        q, k, v, dout, params = _inputs(rng, "decay", shapes[t])
        fns[f"qkv@{t}"] = _qkv_side("decay", q, k, v, dout, params, False)
        fns[f"peer@{t}"] = _peer_side("decay", q, k, v, dout, params, False)
        fns[f"products@{t}"] = decay_products(q, k, v, dout, False)
    runs = rounds(fns, repeats, rotate=True)
    walls = {m: [w for w, _ in r] for m, r in runs.items()}
    ts = list(gr["ts"])
    slope = {side: statistics.median(_slope(ts, [walls[f"{side}@{t}"][r] for t in ts]) for r in range(repeats))
             for side in ("qkv", "peer")}
    med = lambda side, t: statistics.median(walls[f"{side}@{t}"])  # noqa: E731
    per = lambda side, t: statistics.median(  # noqa: E731
        a / b for a, b in zip(walls[f"peer@{t}"], walls[f"{side}@{t}"]))
    return [dict(kernel="decay", group="growth", shape=list(shapes[t]), **{"pass": "fwd"}, qkv_s=med("qkv", t),
                 peer_s=med("peer", t), ratio=per("qkv", t), peer=PEERS["decay"], products_s=med("products", t),
                 bound=per("products", t), slope_qkv=slope["qkv"], slope_peer=slope["peer"]) for t in ts]


def measure(repeats: int, quick: bool, progress=None, *, kernels=KERNELS, layers: bool = True,
            seed: int = 0) -> list[dict]:
    """Every row (see the module docstring); the caller sets the threads of both sides."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = QUICK if quick else FULL
    say = progress or (lambda label: None)
    rows = []
    for kern, shape, pass_ in cases(quick, kernels):
        say(f"{kern} {shape} {pass_}")
        rows.append(_kernel_row(rng, kern, shape, pass_, repeats))
    rows += _growth_rows(rng, sizes["growth"], repeats, say)
    for L in sizes["decode"]["ls"]:
        say(f"decode L={L}")
        rows.append(_decode_row(rng, sizes["decode"], L, repeats))
    if layers:
        from . import recurrent_layers
        rows += recurrent_layers.rows(rng, quick, repeats, _timed, say)
    return rows


def suite(p, progress):
    """``(rows, None)`` for the plan ``p`` of ``suites.run_suites``, or ``([], why)`` when a
    peer's package is missing or PyTorch was left out."""
    missing = peer_missing()
    if missing:
        return [], missing
    if not p.torch:
        return [], "PyTorch was left out (torch=False, --no-torch)"
    started = []

    def told(label):  # measure says a label before each step: the step before it is done
        progress(1 if started else 0, description=f"recurrent: {label}")
        started.append(label)
    rows = measure(p.repeats, p.quick, told)
    progress(1)
    return rows, None
