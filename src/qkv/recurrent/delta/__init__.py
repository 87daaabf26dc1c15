"""``delta_rule``: DeltaNet, Gated DeltaNet (a decay a head) and Kimi Delta Attention (a decay a key channel).

- :mod:`.chunk`: the chunked form's forward (derived in its docstring) and its head groups;
- :mod:`.chunk_parts`: what the forward and backward share: the chunks, ``(I + A)⁻¹``, the state pass;
- :mod:`.backward`: reverse mode through the chunked form;
- :mod:`.channels`: a decay a key channel (KDA): its chunked form and backward, derived there;
- :mod:`.compiled`: the numba passes (the ``fast`` extra), each with the NumPy path's bits;
- :mod:`.naive`: the step-by-step float64 oracle.
"""
