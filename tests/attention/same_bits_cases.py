"""The worker of tests/attention/test_same_bits.py: every float32 kernel on a few problems, twice, in a
fresh process or after a shuffled history of other calls, as sha256 digests of the result bytes.

Run as ``python same_bits_cases.py [STEP ...]`` (the history: see :func:`history`; none:
a fresh process): prints one JSON object
``{"<kernel> <problem> <fwd|bwd> t<threads>": [digest, ...]}``, every distinct digest the
result had in the process (one where a repeated call gave the same bits). A kernel absent from the
process (the compiled row kernel under ``QKV_JIT=0``) is left out.
"""
from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import qkv
from qkv import api
from qkv.threads import kernel_threads

# (name, (B, Hq, Hkv, T, D), options): the tester's window call, and GQA with the score ops
PROBLEMS = [("window", (16, 4, 4, 64, 16), dict(window=(20, 0))),
            ("gqa", (4, 8, 2, 72, 24), dict(gqa=True, causal=True, softcap=20.0, dropout_p=0.1, dropout_seed=5))]


def inputs(shape, seed: int):
    b, hq, hkv, t, d = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, t, d)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal((b, hq, t, d)).astype(np.float32)


def kernels() -> dict:
    """The kernels to compare, by name: a registered method, or the kernel ``auto`` takes
    (the compiled row kernel only where the fast extra is on)."""
    from qkv import jit
    found = {"rows": api.ROWS} if jit.load(jit.ROWS_FUSED) is not None else {}
    found.update({"rows-numpy": api.ROWS_NUMPY, "flash": "flash", "stacked": api.STACKED, "reference": "reference"})
    return found


def takes(name: str, q, k, v, opts) -> bool:
    """Whether kernel ``name`` runs this problem (every one takes the tester's window call)."""
    from qkv.kernels import stacked
    from qkv.kernels.rows import kernel as rows, numpy_rows as rows_numpy
    spec = api.prepare(q, k, v, **opts).spec
    return {"stacked": lambda: stacked.applies(spec), "rows-numpy": lambda: rows_numpy.applies(spec, q.dtype),
            "rows": lambda: rows.applies(spec, q.dtype)}.get(name, lambda: True)()


def run(kernel, q, k, v, dout, opts, backward: bool = True) -> tuple:
    """Forward (out, lse) and backward (dq, dk, dv) of one kernel (None: ``backward=False``)."""
    if isinstance(kernel, str):
        out, lse = qkv.attention(q, k, v, return_lse=True, method=kernel, **opts)
        grads = qkv.attention_backward(dout, q, k, v, out, lse, method=kernel, **opts) if backward else None
        return (out, lse), grads
    prob = api.prepare(q, k, v, **opts)
    out, lse, _ = kernel.forward(prob.q, prob.k, prob.v, prob.spec, prob.scale, prob.group)
    if not backward:
        return (out, lse), None
    return (out, lse), kernel.backward(dout, prob.q, prob.k, prob.v, out, lse, prob.spec, prob.scale, prob.group)


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()[:16]


def measure(found: dict, seen: dict) -> None:
    """Every kernel on every problem it takes, one thread and two: each result's digest added
    to ``seen["<kernel> <problem> <fwd|bwd> t<threads>"]``."""
    for name, kernel in found.items():
        for prob, shape, opts in PROBLEMS:
            arrays = inputs(shape, 0)
            if not takes(name, *arrays[:3], opts):
                continue
            for n in (2, 1):
                with kernel_threads(n):
                    fwd, bwd = run(kernel, *arrays, opts)
                seen.setdefault(f"{name} {prob} fwd t{n}", set()).add(digest(fwd))
                seen.setdefault(f"{name} {prob} bwd t{n}", set()).add(digest(bwd))


# the calls a history is made of: other shapes, masks, GQA, dropout (every kernel that takes them)
STEPS = {"window40": ((16, 4, 4, 40, 16), dict(window=(13, 0))), "window100": ((16, 4, 4, 100, 16), dict(window=(33, 0))),
         "causal100": ((16, 4, 4, 100, 32), dict(causal=True)), "causal48": ((16, 4, 4, 48, 16), dict(causal=True)),
         "chunk90": ((8, 4, 4, 90, 16), dict(chunk=24)), "gqa33": ((2, 6, 2, 33, 8), dict(gqa=True)),
         "dropout128": ((4, 4, 4, 128, 32), dict(dropout_p=0.2, dropout_seed=1)), "gpt": None}


def step(name: str, found: dict, threads: int = 2, backward: bool = False, order=None) -> None:
    """One call of the history: STEPS[name] on every kernel that takes it (a float32 GPT
    training step for "gpt"), forward alone or with the backward."""
    if name == "gpt":
        gpt_step()
        return
    shape, opts = STEPS[name]
    arrays = inputs(shape, 1)
    names = [n for n in found if takes(n, *arrays[:3], opts)]
    for kernel in (names if order is None else order.permutation(names)):
        with kernel_threads(threads):
            run(found[str(kernel)], *arrays, opts, backward=backward)


def history(args: list, found: dict) -> None:
    """``NAME`` (a forward on two threads), ``NAME+bwd`` (with the backward) or ``shuffle=SEED``
    (every step, shuffled, on one thread or two, forward alone or with the backward), in turn."""
    for arg in args:
        if arg.startswith("shuffle="):
            rng = np.random.default_rng(int(arg[8:]))
            for name in rng.permutation(list(STEPS)):
                step(str(name), found, int(rng.integers(1, 3)), bool(rng.integers(2)), rng)
        else:
            step(arg.removesuffix("+bwd"), found, backward=arg.endswith("+bwd"))


def gpt_step() -> None:
    from qkv.models.gpt import GPT, GPTConfig
    from qkv.nn.optim import AdamW

    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=1, n_head=4, n_embd=64))
    opt = AdamW([model], lr=1e-3)
    idx = np.random.default_rng(1).integers(0, 40, (4, 33))
    model.loss(idx[:, :-1], idx[:, 1:])
    model.backward()
    opt.step()


def main(args: list) -> None:
    found, seen = kernels(), {}
    history(args, found)                                  # the heap, caches, threads as other calls left them
    measure(found, seen)
    measure(found, seen)                                  # and a repeated call
    print(json.dumps({key: sorted(digests) for key, digests in seen.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
