"""Distributed: ring attention and data/context parallel training under a real mpiexec.

This folder on sys.path for the helpers beside its tests: mpi_ring_cases.py and mpi_train_cases.py (the workers mpiexec runs); the shared ones
(helpers.py, oracle.py, ...) are in tests/ (its conftest)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
