"""The command line, the experiments, the bench suites, the docs and README, and the code's layout rules.

Shared helpers (helpers.py, oracle.py, recurrent_hf.py, ...) are in tests/ (its conftest)."""
