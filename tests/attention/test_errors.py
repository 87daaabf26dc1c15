"""Every bad input raises qkv.ShapeError naming the argument, what was expected and what came."""
import numpy as np
import pytest

import qkv
from qkv.errors import fmt_shape


def arrays(b=2, hq=4, hkv=2, tq=5, tk=7, d=8, dv=8, dtype=np.float64):
    z = np.zeros
    return z((b, hq, tq, d), dtype), z((b, hkv, tk, d), dtype), z((b, hkv, tk, dv), dtype)


Q, K, V = arrays()
QM, KM, VM = arrays(hkv=4)  # plain multi-head

BAD_CALLS = [
    # (id, args, kwargs, words that must appear in the message)
    ("q-rank", (np.zeros(8), KM, VM), {}, ["q", "at least 2", "(8,)"]),
    ("k-rank", (QM, np.zeros(8), VM), {}, ["k", "at least 2"]),
    ("gqa-rank", (np.zeros((5, 8)), np.zeros((7, 8)), np.zeros((7, 8))), {"gqa": True}, ["q", "(..., Hq, Tq, D)"]),
    ("D-mismatch", (QM, np.zeros((2, 4, 7, 6)), VM), {}, ["k", "D", "(2, 4, 7, 6)", "8"]),
    ("v-length", (QM, KM, np.zeros((2, 4, 6, 8))), {}, ["v", "Tk", "(2, 4, 6, 8)"]),
    ("v-batch", (QM, KM, np.zeros((3, 4, 7, 8))), {}, ["v", "(3, 4, 7, 8)"]),
    ("batch-mismatch", (QM, np.zeros((3, 4, 7, 8)), np.zeros((3, 4, 7, 8))), {}, ["q", "k", "broadcast", "(2, 4, 5, 8)", "(3, 4, 7, 8)"]),
    ("heads-without-gqa", (Q, K, V), {}, ["broadcast", "gqa=True"]),
    ("gqa-not-multiple", (np.zeros((2, 5, 5, 8)), K, V), {"gqa": True}, ["Hq", "Hkv", "multiple", "5", "2"]),
    ("gqa-no-kv-heads", (Q, np.zeros((2, 0, 7, 8)), np.zeros((2, 0, 7, 8))), {"gqa": True}, ["Hkv", ">= 1", "0"]),
    ("gqa-batch", (np.zeros((3, 4, 5, 8)), K, V), {"gqa": True}, ["batch", "q", "k"]),
    ("int-input", (np.zeros((5, 8), int), np.zeros((7, 8)), np.zeros((7, 8))), {}, ["q", "floating", "int64"]),
    ("complex-input", (QM, KM.astype(complex), VM), {}, ["k", "floating", "complex"]),
    ("dtype-mismatch", (QM, KM.astype(np.float32), VM), {}, ["k", "dtype", "float64", "float32"]),
    ("not-array", ("abc", KM, VM), {}, ["q"]),
    ("q-ragged", ([[0.0] * 8, [0.0] * 7], KM, VM), {}, ["q", "rectangular", "list"]),
    ("mask-ragged", (QM, KM, VM), {"mask": [[True] * 7, [True] * 6]}, ["mask", "rectangular", "list"]),
    ("bias-ragged", (QM, KM, VM), {"bias": [[0.0] * 7, [0.0] * 6]}, ["bias", "rectangular"]),
    ("kv-lengths-ragged", (QM, KM, VM), {"kv_lengths": [[3], [4, 5]]}, ["kv_lengths", "rectangular"]),
    ("alibi-ragged", (QM, KM, VM), {"alibi": [[0.5], [0.5, 0.25]]}, ["alibi", "rectangular"]),
    ("empty", (np.zeros((2, 4, 0, 8)), KM, VM), {}, ["Tq", "kv_lengths"]),
    ("mask-dtype", (QM, KM, VM), {"mask": np.ones((5, 7), int)}, ["mask", "bool", "int64", "bias"]),
    ("mask-shape", (QM, KM, VM), {"mask": np.ones((5, 6), bool)}, ["mask", "(..., Hq, Tq, Tk)", "(2, 4, 5, 7)", "(5, 6)"]),
    ("mask-grows", (QM, KM, VM), {"mask": np.ones((3, 2, 4, 5, 7), bool)}, ["mask", "(3, 2, 4, 5, 7)"]),
    ("mask-rank", (QM, KM, VM), {"mask": np.ones(7, bool)}, ["mask", "at least 2"]),
    ("bias-shape", (QM, KM, VM), {"bias": np.zeros((4, 7, 5))}, ["bias", "(2, 4, 5, 7)", "(4, 7, 5)"]),
    ("bias-dtype", (QM, KM, VM), {"bias": np.zeros((5, 7), bool)}, ["bias", "floating", "bool"]),
    ("bias-nan", (QM, KM, VM), {"bias": np.full((5, 7), np.nan)}, ["bias", "NaN"]),
    ("bias-beyond-float32", tuple(x.astype(np.float32) for x in (QM, KM, VM)), {"bias": np.full((5, 7), -1e39)},
     ["bias", "float32", "1e+39", "-inf"]),
    ("causal-word", (QM, KM, VM), {"causal": "bottom-right"}, ["causal", "bottom_right", "'bottom-right'"]),
    ("causal-one", (QM, KM, VM), {"causal": 1}, ["causal", "True", "got 1"]),          # was read as True
    ("causal-float", (QM, KM, VM), {"causal": 1.0}, ["causal", "got 1.0"]),
    ("causal-zero", (QM, KM, VM), {"causal": 0}, ["causal", "got 0"]),                 # was read as False
    ("scale-beyond-float32", tuple(x.astype(np.float32) for x in (QM, KM, VM)), {"scale": 1e39},
     ["scale", "float32", "1e+39"]),                                                    # was all NaN, with warnings
    ("window-negative", (QM, KM, VM), {"window": (-1, 0)}, ["window", "left", ">= 0", "-1"]),
    ("window-malformed", (QM, KM, VM), {"window": (1, 2, 3)}, ["window", "(left, right)", "(1, 2, 3)"]),
    ("window-float", (QM, KM, VM), {"window": 2.5}, ["window", "2.5"]),
    ("window-right-with-causal", (QM, KM, VM), {"window": (2, 1), "causal": True}, ["window=(2, 1)", "causal=True", "(2, 0)"]),
    ("kv-lengths-shape", (QM, KM, VM), {"kv_lengths": np.array([3, 4, 5])}, ["kv_lengths", "(B,)", "(2,)", "(3,)"]),
    ("kv-lengths-range", (QM, KM, VM), {"kv_lengths": np.array([3, 8])}, ["kv_lengths", "[0, 7]", "8"]),
    ("kv-lengths-negative", (QM, KM, VM), {"kv_lengths": np.array([-1, 3])}, ["kv_lengths", "-1"]),
    ("kv-lengths-float", (QM, KM, VM), {"kv_lengths": np.array([3.0, 4.0])}, ["kv_lengths", "integer", "float64"]),
    ("alibi-shape", (QM, KM, VM), {"alibi": np.ones(3)}, ["alibi", "(Hq,)", "(4,)", "(3,)"]),
    ("alibi-2d-input", (np.zeros((5, 8)), np.zeros((7, 8)), np.zeros((7, 8))), {"alibi": np.ones(1)}, ["alibi", "head"]),
    ("scale-nan", (QM, KM, VM), {"scale": float("nan")}, ["scale", "finite", "nan"]),
    ("scale-str", (QM, KM, VM), {"scale": "0.1"}, ["scale", "'0.1'"]),
    ("method", (QM, KM, VM), {"method": "fast"}, ["method", "reference", "'fast'"]),
    ("gqa-type", (QM, KM, VM), {"gqa": "yes"}, ["gqa", "'yes'"]),
    ("return-flag", (QM, KM, VM), {"return_lse": 1}, ["return_lse", "True or False"]),
]


@pytest.mark.parametrize("args,kwargs,words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_shape_error_naming_the_argument(args, kwargs, words):
    with pytest.raises(qkv.ShapeError) as info:
        qkv.attention(*args, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_shape_error_is_a_value_error_and_hides_internal_frames():
    assert issubclass(qkv.ShapeError, ValueError)
    with pytest.raises(qkv.ShapeError) as info:
        qkv.attention(QM, KM, VM, window=-3)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert info.traceback[-1].name == "attention"  # raised from the public entry point


BAD_BACKWARD = [
    ("dout-shape", {"dout": np.zeros((2, 4, 5, 7))}, ["dout", "(..., Hq, Tq, Dv)", "(2, 4, 5, 8)", "(2, 4, 5, 7)"]),
    ("out-shape", {"out": np.zeros((2, 4, 5))}, ["out", "(2, 4, 5, 8)"]),
    ("lse-shape", {"lse": np.zeros((2, 4, 5, 1))}, ["lse", "(..., Hq, Tq)", "(2, 4, 5)"]),
    ("lse-int", {"lse": np.zeros((2, 4, 5), int)}, ["lse", "floating"]),
]


@pytest.mark.parametrize("override,words", [c[1:] for c in BAD_BACKWARD], ids=[c[0] for c in BAD_BACKWARD])
def test_bad_backward_input_names_the_argument(override, words):
    out, lse = qkv.attention(QM, KM, VM, return_lse=True)
    call = {"dout": np.ones_like(out), "out": out, "lse": lse}
    call.update(override)
    with pytest.raises(qkv.ShapeError) as info:
        qkv.attention_backward(call["dout"], QM, KM, VM, call["out"], call["lse"])
    for word in words:
        assert word in str(info.value)


def test_backward_checks_options_like_forward():
    out, lse = qkv.attention(QM, KM, VM, return_lse=True)
    with pytest.raises(qkv.ShapeError, match="causal"):
        qkv.attention_backward(out, QM, KM, VM, out, lse, causal="yes")


def test_message_helpers():
    assert fmt_shape((3,)) == "(3,)" and fmt_shape(()) == "()" and fmt_shape((2, 4)) == "(2, 4)"
