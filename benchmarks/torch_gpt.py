"""The plain PyTorch GPT that qkv's NumPy GPT is checked and timed against (``torch.nn`` only).

nanoGPT's architecture, written out: token and (learned) position embeddings, ``n_layer``
pre-norm blocks of causal self-attention (one fused ``c_attn`` for q, k, v;
``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm, and an LM head tied
to the token embedding. The options of :class:`qkv.models.GPTConfig` are mirrored: GQA
(``n_kv_head``), RoPE (half-split, as :func:`qkv.positional.rope`), ``bias``, the MLP
activation (``gelu``, ``gelu_tanh``, ``swiglu``), untied heads, dropout (embedding, residual and
attention weights, as nanoGPT's; the two models draw different masks).

- :func:`make_torch_gpt` ``(config) -> torch.nn.Module``: ``model(idx, targets)`` returns
  ``(logits, loss)`` like nanoGPT's; parameters in ``config.dtype``.
- :func:`load_qkv_weights` ``(torch_model, qkv_gpt)``: copy every qkv array in (qkv's
  ``W (in, out)`` is ``nn.Linear``'s weight transposed; ``W_Q, W_K, W_V`` are row blocks
  of ``c_attn.weight``).
- :func:`qkv_grads` ``(torch_model, qkv_gpt) -> {qkv name: array}``: the torch gradients in
  qkv's names and layouts, to compare with ``qkv_gpt.grads``.
- :func:`make_adamw` ``(torch_model, lr, ...)``: ``torch.optim.AdamW`` with qkv's groups
  (decay on matrices, none on the embeddings, norms and biases).

The tests (tests/layers/test_gpt.py) and the ``gpt`` bench suite import this module as
``qkv_benchmarks.torch_gpt``; torch is imported here at the top, so import it only where
torch is installed.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.float16): torch.float16}


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split rotary embedding of ``x (B, H, T, D)`` at positions 0..T-1 (qkv.positional.rope)."""
    t, d = x.shape[-2:]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)           # (D/2,)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * theta[None, :]      # (T, D/2)
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_kv_head = c.n_head, c.n_kv_head or c.n_head
        self.hs = c.n_embd // c.n_head
        self.rope, self.rope_base = c.positions == "rope", c.rope_base
        self.c_attn = nn.Linear(c.n_embd, (self.n_head + 2 * self.n_kv_head) * self.hs, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.attn_dropout = c.dropout

    def forward(self, x):
        b, t, c = x.shape
        hq, hkv = self.n_head * self.hs, self.n_kv_head * self.hs
        q, k, v = self.c_attn(x).split([hq, hkv, hkv], dim=2)
        q = q.view(b, t, self.n_head, self.hs).transpose(1, 2)      # (B, nh, T, hs)
        k = k.view(b, t, self.n_kv_head, self.hs).transpose(1, 2)   # (B, nkv, T, hs)
        v = v.view(b, t, self.n_kv_head, self.hs).transpose(1, 2)
        if self.rope:
            q, k = rope(q, self.rope_base), rope(k, self.rope_base)
        if self.n_kv_head != self.n_head:
            g = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,  # (B, nh, T, hs)
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        f = c.n_inner or 4 * c.n_embd
        self.activation = c.activation
        self.c_fc = nn.Linear(c.n_embd, f, bias=c.bias)
        self.c_gate = nn.Linear(c.n_embd, f, bias=c.bias) if c.activation == "swiglu" else None
        self.c_proj = nn.Linear(f, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.activation == "swiglu":
            h = F.silu(self.c_gate(x)) * h
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        parts = dict(wte=nn.Embedding(c.vocab_size, c.n_embd), drop=nn.Dropout(c.dropout),
                     h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
                     ln_f=nn.LayerNorm(c.n_embd, eps=c.layer_norm_eps, bias=c.bias))
        if c.positions == "learned":
            parts["wpe"] = nn.Embedding(c.block_size, c.n_embd)
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.transformer.wte(idx)                                # (B, T, C)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(t, device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))              # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def make_torch_gpt(config) -> nn.Module:
    """A :class:`TorchGPT` of ``config`` (a :class:`qkv.models.GPTConfig`) in its dtype."""
    return TorchGPT(config).to(TORCH_DTYPES[np.dtype(config.dtype)])


def param_map(torch_model: nn.Module, qkv_gpt) -> list[tuple[str, torch.Tensor, slice | None, bool]]:
    """``(qkv name, torch parameter, rows of it or None, transposed)`` for every qkv parameter."""
    c = qkv_gpt.config
    hs = c.n_embd // c.n_head
    hq, hkv = c.n_head * hs, (c.n_kv_head or c.n_head) * hs
    tp = dict(torch_model.named_parameters(remove_duplicate=False))
    rows = []
    for name in qkv_gpt.params:
        if name in ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight") or ".ln_" in name:
            rows.append((name, tp[name], None, False))
            continue
        prefix, leaf = name.rsplit(".", 1)                        # transformer.h.i.attn, W_Q
        kind, part = leaf.split("_")                              # W / b, Q / fc / ...
        attr = "weight" if kind == "W" else "bias"
        if prefix.endswith("attn") and part in "QKV":
            start = {"Q": 0, "K": hq, "V": hq + hkv}[part]
            width = hq if part == "Q" else hkv
            rows.append((name, tp[f"{prefix}.c_attn.{attr}"], slice(start, start + width), kind == "W"))
        else:
            module = {"O": "c_proj", "fc": "c_fc", "gate": "c_gate", "proj": "c_proj"}[part]
            rows.append((name, tp[f"{prefix}.{module}.{attr}"], None, kind == "W"))
    return rows


@torch.no_grad()
def load_qkv_weights(torch_model: nn.Module, qkv_gpt) -> nn.Module:
    """Copy every parameter of ``qkv_gpt`` into ``torch_model`` (same config); returns it."""
    for name, param, rows, transposed in param_map(torch_model, qkv_gpt):
        value = torch.from_numpy(np.ascontiguousarray(qkv_gpt.params[name])).to(param.dtype)
        value = value.T if transposed else value
        (param if rows is None else param[rows]).copy_(value)
    return torch_model


def qkv_grads(torch_model: nn.Module, qkv_gpt) -> dict[str, np.ndarray]:
    """The torch model's ``.grad`` of each qkv parameter, in qkv's name and layout."""
    out = {}
    for name, param, rows, transposed in param_map(torch_model, qkv_gpt):
        g = param.grad if rows is None else param.grad[rows]
        out[name] = (g.T if transposed else g).detach().cpu().numpy().copy()
    return out


def make_adamw(torch_model: nn.Module, lr: float, *, betas=(0.9, 0.95), eps: float = 1e-8,
               weight_decay: float = 0.1) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with qkv's groups: decay on matrices except the embeddings."""
    emb = {id(m.weight) for m in torch_model.modules() if isinstance(m, nn.Embedding)}
    params = list(torch_model.parameters())  # shared (tied) parameters appear once
    decay = [p for p in params if p.dim() >= 2 and id(p) not in emb]
    rest = [p for p in params if not (p.dim() >= 2 and id(p) not in emb)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def clip_and_step(torch_model: nn.Module, optimizer, clip: float | None, lr: float | None = None) -> float:
    """Clip by the global norm (as qkv's AdamW, ``clip=``), set ``lr``, step; returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), clip if clip is not None else math.inf)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    return float(norm)
