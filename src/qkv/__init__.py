"""qkv: self-attention, derived from scratch and built to be used.

Layout convention: arrays are ``(..., T, D)`` (the last two axes are sequence and
feature). With 4-D arrays, ``q (B, Hq, Tq, D)``, ``k (B, Hkv, Tk, D)``,
``v (B, Hkv, Tk, Dv)``; a 2-D ``(T, D)`` array is one sequence. Masks are bool with
True = may attend, as in PyTorch's scaled_dot_product_attention.
"""
from . import nn, positional, recurrent
from .api import attention, attention_backward
from .errors import OptionError, ShapeError
from .linear_api import linear_attention, linear_attention_backward
from .threads import get_num_threads, set_num_threads
from .numerics import logsumexp, softmax

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "linear_attention", "linear_attention_backward",
           "softmax", "logsumexp", "ShapeError", "OptionError",
           "set_num_threads", "get_num_threads", "nn", "positional", "recurrent"]
