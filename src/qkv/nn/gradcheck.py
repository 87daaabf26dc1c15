"""Finite-difference checks of a layer's backward against its forward (float64).

For a random ``R`` of the output's shape the loss ``L = Σ y ∘ R`` has ``∂L/∂y = R``; the
layer's ``backward(R)`` must then match the central difference
``(L(θ + ε e_i) - L(θ - ε e_i)) / 2ε`` on every parameter and input entry it is asked about.
"""
from __future__ import annotations

import numpy as np


def gradient_errors(layer, *inputs: np.ndarray, n_checks: int = 8, eps: float = 1e-6,
                    seed: int = 0, **forward_kwargs) -> dict[str, float]:
    """Relative error of ``layer.backward`` per parameter and input, on sampled entries.

    ``inputs`` are float64 arrays passed positionally to ``layer.forward`` (perturbed in
    place and restored); ``forward_kwargs`` go along unchanged. For each array, up to
    ``n_checks`` random entries are compared; the error is ``max |numeric - analytic|``
    divided by the largest analytic entry of that array (so an exact match is ~1e-9), or
    the absolute error where the analytic gradient is 0 everywhere.
    Keys: parameter names and ``"input0"``, ``"input1"``, ...
    """
    rng = np.random.default_rng(seed)
    y = layer.forward(*inputs, **forward_kwargs)
    r = rng.standard_normal(y.shape)
    d_inputs = layer.backward(r)
    if not isinstance(d_inputs, tuple):
        d_inputs = (d_inputs,)
    analytic = {f"input{i}": np.asarray(d) for i, d in enumerate(d_inputs)}
    analytic.update({name: g.copy() for name, g in layer.grads.items()})
    arrays = {f"input{i}": x for i, x in enumerate(inputs)}
    arrays.update(layer.params)

    def loss() -> float:
        return float(np.sum(layer.forward(*inputs, **forward_kwargs) * r))

    errors = {}
    for name, arr in arrays.items():
        flat = arr.reshape(-1)  # a view: perturbing it perturbs arr
        picks = rng.choice(flat.size, size=min(n_checks, flat.size), replace=False)
        worst = 0.0
        for i in picks:
            old = flat[i]
            flat[i] = old + eps
            up = loss()
            flat[i] = old - eps
            down = loss()
            flat[i] = old
            numeric = (up - down) / (2 * eps)
            worst = max(worst, abs(numeric - analytic[name].reshape(-1)[i]))
        scale = float(np.max(np.abs(analytic[name])))
        # A gradient that is 0 by the math (b_K: adding one vector to every key shifts a
        # query's scores by a constant, which softmax ignores) is judged absolutely.
        errors[name] = worst / scale if scale > 1e-9 else worst
    return errors
