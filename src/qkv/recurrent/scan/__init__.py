"""``linear_scan``: Griffin's diagonal recurrence ``h_t = exp(log_a_t) ∘ h_{t-1} + x_t``.

- :mod:`.chunk`: the blocked scan and the step loop of wide states, forward and backward;
- :mod:`.compiled`: the step loop and its backward as numba passes (the ``fast`` extra);
- :mod:`.naive`: the step-by-step float64 oracle.
"""
