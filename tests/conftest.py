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


DIFFERENTIAL = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def differential_counts(request):
    """Cases run per entry point by tests/attention/test_differential.py, printed in the summary."""
    return request.config.stash.setdefault(DIFFERENTIAL, {})


def pytest_terminal_summary(terminalreporter, config):
    counts = config.stash.get(DIFFERENTIAL, None)
    if counts:
        listing = ", ".join(f"{kind} {n}" for kind, n in counts.items())
        terminalreporter.write_line(f"differential harness: {sum(counts.values())} cases run ({listing})")
