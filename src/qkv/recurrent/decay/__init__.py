"""``decay_attention``: linear attention with a decaying state (Mamba-2's SSD, GLA, RetNet).

- :mod:`.chunk`: the chunked form, forward and backward (derived in its docstring);
- :mod:`.intra`: the decayed products inside a chunk (a decay a head or a key channel);
- :mod:`.fused`: float32 with a decay a head, chunk after chunk in one compiled loop;
- :mod:`.compiled`: the numba passes (the ``fast`` extra), each with the NumPy path's bits;
- :mod:`.naive`: the step-by-step float64 oracle, ``S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ``.
"""
