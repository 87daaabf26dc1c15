"""Bert.encode(threads=n) keeps its thread counts to its own calls: concurrent callers leave
every process-wide setting as it was and get what a serial call gets."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the models extra (safetensors)")
pytest.importorskip("tokenizers", reason="needs the models extra (tokenizers)")

import qkv  # noqa: E402
from qkv import threads  # noqa: E402

pytestmark = pytest.mark.slow  # threads racing over a real model: the slow leg (pytest -m slow)

# ~120 tokens each: a batch of 2 has 2 x 12 heads x 120^2 score entries, past
# api.AUTO_FLASH_MIN, so the tiled kernel runs and would hand tiles to threads.
TEXTS = [f"Text {i}: " + "the animal did not cross the street because it was too tired, " * 10 for i in range(8)]


@pytest.fixture(scope="module")
def model(minilm):
    return minilm


def blas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_concurrent_encodes_leave_the_settings_and_agree(model):
    """Four threads calling encode(threads=2) at once (issue 13 item 5) leave the user's
    process-wide kernel threads and BLAS's limit as they were, and agree with a serial call."""
    qkv.set_num_threads(3)  # the user's process-wide choice, which no encode may change
    try:
        blas_before = blas_threads()
        serial = model.encode(TEXTS, batch_size=2, threads=2)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: model.encode(TEXTS, batch_size=2, threads=2), range(4)))
        assert qkv.get_num_threads() == 3
        assert blas_threads() == blas_before
        assert threads.blas_holders() == 0
    finally:
        qkv.set_num_threads(None)
    for r in results:
        np.testing.assert_allclose(r, serial, atol=2e-6, rtol=0)
