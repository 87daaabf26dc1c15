"""Training qkv's GPT on the W ranks of an MPI communicator, as one process would train it.

Two ways to share out one step's batch ``x, y (B, T)`` (``N = B·T`` tokens); every rank
draws the same global batch from the run's Generator and keeps its part::

    data     rank r keeps rows  r·B/W .. (r+1)·B/W - 1          (B/W, T)    whole model per rank
    context  rank r keeps its tokens of every row (zigzag:       (B, T/W)    each block's attention
             chunks r and 2W-1-r of 2W, :mod:`.layout`)                      is ring attention

Under ``context`` the embeddings, norms, MLPs, head and loss run on the local tokens; each
block's attention is :class:`~qkv.distributed.RingMultiHeadAttention` (the keys travel the
ring, :mod:`.ring`), which rotates RoPE at the global positions; learned positions are read
(and their gradient written) at the global positions too (``GPT.token_positions``).

**Loss and gradients.** A rank's loss is the mean over its ``N/W`` tokens; the batch's is
the mean of the W (equal counts). Every gradient is linear in
``dlogits = (softmax - onehot) / (N/W)``, so the sum over ranks of the local gradients,
divided by W, is the gradient of the global mean (a ring layer's dK/dV already carry
every rank's queries: the ring sends them home)::

    loss = (1/W) Σ_r loss_r              one Allreduce of a scalar
    g    = (1/W) Σ_r g_r                 one Allreduce of one flat buffer of every gradient

Then every rank steps its own AdamW on the same gradients (clipped by the same global
norm), so the parameters stay equal everywhere and are never sent. A checkpoint is one
process's (rank 0 writes it) and resumes with any W.

**Memory per rank.** Parameters and AdamW's moments: the whole model on every rank (16
bytes a parameter in float32). Activations: those of ``N/W`` tokens in both modes; with
``context`` that is what lets a ``block_size`` train that one process cannot hold: each
rank keeps ``B·T/W`` tokens of activations and attention holds ``O(T/W · D)`` per head,
never a ``T × T`` array.

Dropout: rank 0 draws from the run's Generator and rank r > 0 from its own, so with
``dropout > 0`` the masks differ from one process's (the losses are equal only without it).
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..extras import require
from .layer import RingMultiHeadAttention
from .layout import check_layout, n_chunks, positions, shard, world

MODES = ("data", "context")


def check_mode(mode: str, layout: str = "zigzag") -> None:
    """``mode`` is one of :data:`MODES` and ``layout`` one of the ring's, else a ShapeError."""
    if mode not in MODES:
        raise ShapeError(f"parallel must be one of {list(MODES)}; got {mode!r}")
    check_layout(layout)


def check_split(mode: str, batch_size: int, block_size: int, size: int, layout: str = "zigzag") -> None:
    """Raise a ShapeError naming the argument when ``mode`` cannot share out a ``(batch_size,
    block_size)`` batch over ``size`` ranks."""
    check_mode(mode, layout)
    if mode == "data" and batch_size % size:
        raise ShapeError(f"batch_size = {batch_size} must be a multiple of the W = {size} ranks: data "
                         f"parallel gives each rank batch_size / W rows of every batch")
    parts = n_chunks(layout, size)
    if mode == "context" and block_size % parts:
        raise ShapeError(f"block_size = {block_size} must be a multiple of {parts} for context parallel "
                         f"over W = {size} ranks (layout {layout!r} cuts each sequence into {parts} equal chunks)")


def check_context_layers(config) -> None:
    """Context parallel runs every block's mixer as ring attention: a ShapeError naming the first
    block that is not plain causal softmax attention (a recurrent state would have to pass
    from rank to rank, and the ring layer has no window or chunk)."""
    for i, kind in enumerate(config.layer_kinds):
        if kind != "attention":
            raise ShapeError(f"parallel = 'context' needs plain softmax attention in every layer (ring attention); "
                             f"layers = {config.layers!r} has {kind!r} at layer {i}: train it with parallel = 'data'")


class ParallelGPT:
    """A :class:`qkv.models.GPT` trained by every rank of ``comm`` together (see the module docstring).

    ``ParallelGPT(model, "data" | "context", comm=None, layout="zigzag")``: ``model`` is the
    same GPT on every rank (same config and parameters). Under ``"context"`` the wrapped
    model is a copy whose attention layers are ring layers. ``loss(idx, targets)`` takes the
    *global* batch ``(B, T)`` and returns the global mean loss; ``backward()`` leaves the
    global gradient in ``grads`` on every rank. Both are collective: every rank calls them,
    in the same order. ``params``, ``grads``, ``no_decay``, ``rng`` and ``config`` are the
    local model's, so an optimizer and ``runfiles.save_run`` use it as they use a GPT.

    ``comm_seconds`` adds up the time spent in the Allreduces of the ``"loss"`` and of the
    ``"grads"`` (waiting for the slowest rank included); ``grad_bytes`` is the size of the
    flat gradient buffer.
    """

    def __init__(self, model, mode: str, *, comm=None, layout: str = "zigzag"):
        self.comm, self.size, self.rank = world(comm)
        check_mode(mode, layout)
        if mode == "context":
            check_context_layers(model.config)
        self.mode, self.layout = mode, layout
        self.model = _ring_copy(model, self.comm, layout) if mode == "context" else model
        self._slices, n = {}, 0
        for name, g in self.model.grads.items():
            self._slices[name] = slice(n, n + g.size)
            n += g.size
        self._flat = np.empty(n, self.model.config.dtype)  # every gradient, in params order
        self.grad_bytes = self._flat.nbytes
        self.comm_seconds = {"loss": 0.0, "grads": 0.0}

    # --- what an optimizer and the run files read: the local model's --------------------
    params = property(lambda self: self.model.params)
    grads = property(lambda self: self.model.grads)
    no_decay = property(lambda self: self.model.no_decay)
    rng = property(lambda self: self.model.rng)
    config = property(lambda self: self.model.config)
    training = property(lambda self: self.model.training)

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def save(self, directory, extra: dict | None = None) -> None:
        """``GPT.save`` of the (identical) parameters: call it on one rank only."""
        self.model.save(directory, extra=extra)

    # --- the step ----------------------------------------------------------------------
    def local(self, a: np.ndarray) -> np.ndarray:
        """This rank's part of a global ``(B, T)`` array: its rows, or its tokens of each row."""
        if self.mode == "data":
            b = a.shape[0] // self.size
            return a[self.rank * b:(self.rank + 1) * b]
        return shard(a, comm=self.comm, layout=self.layout, axis=1)

    def loss(self, idx, targets) -> float:
        """The mean cross-entropy over the whole global batch ``idx, targets (B, T)`` (collective)."""
        idx, targets = np.asarray(idx), np.asarray(targets)
        if idx.ndim != 2 or targets.shape != idx.shape:
            raise ShapeError(f"idx and targets must be token ids of one shape (B, T); got "
                             f"{fmt_shape(idx.shape)} and {fmt_shape(targets.shape)}")
        b, t = idx.shape
        check_split(self.mode, b, t, self.size, self.layout)
        if self.mode == "context":
            if t > self.config.block_size:
                raise ShapeError(f"idx has T = {t} tokens, more than block_size = {self.config.block_size}")
            self.model.token_positions = positions(t, comm=self.comm, layout=self.layout)
        local = np.array([self.model.loss(self.local(idx), self.local(targets))], np.float64)
        self._allreduce(local, "loss")
        return float(local[0]) / self.size

    def backward(self) -> None:
        """Fill ``grads`` with the gradient of the last global :meth:`loss` on every rank (collective)."""
        self.model.backward()
        grads, flat = self.model.grads, self._flat
        for name, s in self._slices.items():
            flat[s] = grads[name].reshape(-1)
        self._allreduce(flat, "grads")
        flat /= self.size
        for name, s in self._slices.items():
            grads[name][...] = flat[s].reshape(grads[name].shape)

    def _allreduce(self, buf: np.ndarray, what: str) -> None:
        MPI = require("mpi4py.MPI", "mpi")
        t0 = time.perf_counter()
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        self.comm_seconds[what] += time.perf_counter() - t0


def _ring_copy(model, comm, layout: str):
    """``model`` again with every block's attention a ring layer (same parameters and
    Generator state; the layers sum nothing: ParallelGPT sums every gradient at once)."""
    from ..models import GPT

    ring = partial(RingMultiHeadAttention, comm=comm, layout=layout, sum_grads=False)
    copy = GPT(model.config, attention=ring)
    for name, p in model.params.items():
        copy.params[name][...] = p
    copy.rng.bit_generator.state = model.rng.bit_generator.state  # in place: the dropout layers share it
    return copy.train(model.training)


def parallelize(run, mode: str, *, comm=None, layout: str = "zigzag"):
    """Make ``run`` (a :class:`qkv.training.loop.Run`, new or loaded on every rank) train on
    every rank of ``comm``: its model becomes a :class:`ParallelGPT` and its AdamW one over the
    local model with the same state. Returns ``run``; :func:`qkv.training.loop.train` then
    trains it, every rank calling it, with the checkpoint written by rank 0 alone.

    Collective: every rank checks that the batch splits (a ShapeError naming ``batch_size``
    or ``block_size``) and the ranks compare their runs (config, step, data, the parameters'
    sum); if any rank failed or they differ, every rank raises the same ShapeError."""
    from dataclasses import asdict

    from ..training.loop import make_optimizer
    from .agree import agree

    comm, size, rank = world(comm)

    def check():
        check_split(mode, run.cfg.batch_size, run.cfg.block_size, size, layout)
        if mode == "context":
            check_context_layers(run.model.config)
        par = ParallelGPT(run.model, mode, comm=comm, layout=layout)
        opt = make_optimizer(par.model, run.cfg)
        opt.load_state_dict(run.opt.state_dict())
        return par, opt
    total = float(sum(np.sum(p, dtype=np.float64) for p in run.model.params.values()))
    par, opt = agree(comm, "parallelize", check, dict(
        mode=mode, layout=layout, config=sorted(asdict(run.cfg).items()), step=run.step,
        data=sorted(run.data.items()), parameter_sum=total))
    if rank:  # the dropout masks: a stream of its own on every rank but 0 (see the module docstring)
        par.rng.bit_generator.state = np.random.default_rng((3, run.cfg.seed, rank, run.step)).bit_generator.state
    run.model, run.opt = par, opt
    return run
