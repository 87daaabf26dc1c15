"""Attention: the kernels (reference, stacked, rows, flash, linear), the public calls' options, masks, errors, numerics and bits, and what they run on (threads, workspace, the compile cache).

This folder on sys.path for the helpers beside its tests: flash_helpers.py, row_cases.py and same_bits_cases.py; the shared ones
(helpers.py, oracle.py, ...) are in tests/ (its conftest)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
