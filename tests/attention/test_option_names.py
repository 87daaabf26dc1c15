"""Keyword names brought from torch's scaled_dot_product_attention, flash-attn or Hugging Face
are a qkv.ShapeError that gives qkv's name for the same thing, not a bare TypeError."""
import numpy as np
import pytest

import qkv

Q = np.zeros((2, 4, 5, 8))
K = V = np.zeros((2, 4, 7, 8))


@pytest.mark.parametrize("kwargs, words", [
    ({"is_causal": True}, ["is_causal=", "causal=True"]),
    ({"dropout": 0.1}, ["dropout=", "dropout_p=", "dropout_seed="]),
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=", "softcap="]),
    ({"attn_mask": np.ones((5, 7), bool)}, ["attn_mask=", "mask=", "True = may attend", "bias="]),
    ({"enable_gqa": True}, ["enable_gqa=", "gqa=True"]),
    ({"casual": True}, ["casual=", "its options are mask, bias, causal"]),
    ({"is_causal": True, "dropout": 0.1}, ["unknown keyword arguments", "is_causal=", "dropout="]),
])
def test_torch_habits_point_to_qkv_names(kwargs, words):
    """Names from torch's scaled_dot_product_attention are a ShapeError giving qkv's name, not a TypeError."""
    with pytest.raises(qkv.ShapeError) as err:
        qkv.attention(Q, K, V, **kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_torch_habits_in_the_backward():
    out, lse = qkv.attention(Q, K, V, return_lse=True)
    with pytest.raises(qkv.ShapeError, match=r"attention_backward got an unknown keyword argument is_causal= "
                                             r"\(qkv's name: causal=True.*its options are mask, .*gqa, method$"):
        qkv.attention_backward(out, Q, K, V, out, lse, is_causal=True)

