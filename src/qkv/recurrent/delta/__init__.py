"""``delta_rule``: DeltaNet and Gated DeltaNet (a decay a head).

- :mod:`.chunk`: the chunked form's forward (derived in its docstring) and its head groups;
- :mod:`.chunk_parts`: what the forward and backward share: the chunks, ``(I + A)⁻¹``, the state pass;
- :mod:`.backward`: reverse mode through the chunked form;
- :mod:`.compiled`: the numba passes (the ``fast`` extra), each with the NumPy path's bits;
- :mod:`.naive`: the step-by-step float64 oracle.
"""
