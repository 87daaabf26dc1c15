"""Shared test set-up: tests/ on sys.path for the test-side oracles in helpers.py, and the
default pretrained model loaded once for the whole run."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def minilm():
    """``qkv.models.load_bert()`` (all-MiniLM-L6-v2), loaded once for every test file that reads
    it (none changes it), or a skip that names the missing extra or model."""
    from qkv.extras import MissingExtra
    from qkv.models import load_bert

    try:
        return load_bert()
    except MissingExtra as err:
        pytest.skip(str(err))
