"""``dplr``: the diagonal-plus-low-rank transition of RWKV-7 (flash-linear-attention's
``generalized_delta_rule``), ``S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``.

(The folder is not named ``dplr``: that is the public function :func:`qkv.recurrent.dplr`.)

- :mod:`.chunk`: the chunked form's forward (derived in its docstring);
- :mod:`.chunk_parts`: the chunks' pieces the forward and backward share;
- :mod:`.scores`: the masked, decayed products inside a chunk;
- :mod:`.backward`: reverse mode through the chunked form;
- :mod:`.compiled`: the float32 backward's numba passes (loaded through ``qkv.jit``);
- :mod:`.naive`: the step-by-step float64 oracle.
"""
