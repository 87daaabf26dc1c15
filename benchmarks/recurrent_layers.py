"""The recurrent suite's layer rows: qkv's NumPy layers against transformers' own modules.

- ``mamba2``: :class:`qkv.nn.Mamba2` built by ``from_hf`` from transformers' ``Mamba2Mixer``
  (on the CPU it runs ``torch_forward``: its torch chunk scan), same weights, same input;
- ``gated_delta``: :class:`qkv.nn.GatedDeltaNet` from ``Qwen3NextGatedDeltaNet`` (its
  ``torch_chunk_gated_delta_rule``).

Input ``(B, T, hidden)`` float32; ``fwd`` is the layer's output, ``fwd+bwd`` adds the gradient
of every parameter and of the input (``layer.backward`` against torch autograd). The
sizes are Mamba-2's and Qwen3-Next's proportions at a small width: Mamba-2 with 64-wide
heads, state 64, expand 2; Gated DeltaNet with 8 key heads and 16 value heads of 64.
"""
from __future__ import annotations

FULL = (("mamba2", (1, 2048, 512)), ("gated_delta", (1, 2048, 512)))
QUICK = (("mamba2", (1, 64, 32)), ("gated_delta", (1, 64, 32)))
PEERS = {"mamba2": "transformers Mamba2Mixer (torch chunk scan)",
         "gated_delta": "transformers Qwen3NextGatedDeltaNet (torch_chunk_gated_delta_rule)"}


def _module(kind: str, hidden: int):
    """transformers' module at width ``hidden`` (float32, eval)."""
    import torch

    torch.manual_seed(0)
    if kind == "mamba2":
        from transformers.models.mamba2.configuration_mamba2 import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
        head_dim = 64 if hidden >= 128 else 8
        cfg = Mamba2Config(hidden_size=hidden, num_heads=2 * hidden // head_dim, head_dim=head_dim,
                           state_size=64 if hidden >= 128 else 8, n_groups=1, expand=2, num_hidden_layers=1,
                           vocab_size=11)
        return Mamba2Mixer(cfg, layer_idx=0).eval()
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    dim, k_heads = (64, hidden // 64) if hidden >= 128 else (8, 2)
    cfg = Qwen3NextConfig(hidden_size=hidden, linear_num_key_heads=k_heads, linear_num_value_heads=2 * k_heads,
                          linear_key_head_dim=dim, linear_value_head_dim=dim, num_hidden_layers=1,
                          layer_types=["linear_attention"], vocab_size=11, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8)
    return Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()


def _sides(kind: str, shape, backward: bool, rng):
    import numpy as np
    import torch

    from qkv import nn
    B, T, hidden = shape
    module = _module(kind, hidden)
    layer = {"mamba2": nn.Mamba2, "gated_delta": nn.GatedDeltaNet}[kind].from_hf(module, dtype=np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)

    def ours():
        y = layer.forward(x)
        if backward:
            layer.backward(dy)
        return y

    def peer():
        if not backward:
            with torch.no_grad():
                return module(xt)
        module.zero_grad(set_to_none=True)
        xg = xt.clone().requires_grad_()
        module(xg).backward(dyt)
    return {"qkv": ours, "peer": peer}


def rows(rng, quick: bool, repeats: int, timed, say) -> list[dict]:
    """The layer rows, timed by the suite's ``timed(fns, repeats) -> (secs, per)``."""
    out = []
    for kind, shape in (QUICK if quick else FULL):
        for pass_ in ("fwd", "fwd+bwd"):
            say(f"layer {kind} {shape} {pass_}")
            secs, per = timed(_sides(kind, shape, pass_ == "fwd+bwd", rng), repeats)
            out.append(dict(kernel=kind, group="layer", shape=list(shape), **{"pass": pass_}, qkv_s=secs["qkv"],
                            peer_s=secs["peer"], ratio=per("qkv"), peer=PEERS[kind], products_s=None, bound=None))
    return out
