"""The old name of the recurrences' step-by-step oracles, kept for code written against it.

They now live beside their ops, one folder an op (:mod:`qkv.recurrent`):
:mod:`qkv.recurrent.decay.naive`, :mod:`qkv.recurrent.delta.naive`,
:mod:`qkv.recurrent.generalized_delta.naive`, :mod:`qkv.recurrent.scan.naive`.
"""
from ..recurrent.decay.naive import decay_backward, decay_forward
from ..recurrent.delta.naive import delta_backward, delta_forward
from ..recurrent.generalized_delta.naive import dplr_backward, dplr_forward
from ..recurrent.scan.naive import scan_backward, scan_forward

__all__ = ["decay_forward", "decay_backward", "delta_forward", "delta_backward", "dplr_forward",
           "dplr_backward", "scan_forward", "scan_backward"]
