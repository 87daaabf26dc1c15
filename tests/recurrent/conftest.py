"""The recurrences (qkv.recurrent): each op's chunked form and compiled passes against its step-loop oracle and flash-linear-attention's naive references.

This folder on sys.path for the helpers beside its tests: fla_reference.py; the shared ones
(helpers.py, oracle.py, ...) are in tests/ (its conftest)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
