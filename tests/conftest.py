"""Shared test set-up: tests/ on sys.path for the test-side oracles in helpers.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
