"""What a real pretrained model attends to, layer by layer (the library half of ``qkv explain``).

:func:`explain` runs a text through all-MiniLM-L6-v2 (or any BERT-family folder) on qkv's
attention and returns every layer's and head's weights, the tokens, and for one token
(default "it") the tokens it attends to most in each layer, averaged over the heads. The
command line draws the pictures (:mod:`qkv.viz`) and prints the summary.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
SPECIALS = ("[CLS]", "[SEP]", "<s>", "</s>")


def find_token(model, tokens: list[str], word: str) -> int:
    """Position of ``word``'s first word piece in ``tokens`` (first occurrence)."""
    pieces = [t for t in model.tokenize([word])[0].tokens if t not in SPECIALS]
    if not pieces:
        raise ShapeError(f"token must be a word; got {word!r}")
    n = len(pieces)
    for i in range(len(tokens) - n + 1):
        if tokens[i:i + n] == pieces:
            return i
    shown = " ".join(tokens[:40]) + (" ..." if len(tokens) > 40 else "")
    raise ShapeError(f"token {word!r} (word pieces {pieces}) is not in the text's tokens: {shown}")


def top_keys(attentions: np.ndarray, tokens: list[str], i: int, n: int = 3) -> list[list[tuple[str, int, float]]]:
    """Per layer, the ``n`` keys query ``i`` weights most, averaged over heads, specials left out:
    ``[(token, position, weight), ...]`` (the position tells repeated tokens apart)."""
    mean = attentions[:, :, i, :].mean(axis=1)  # (L, H, T) -> (L, T)
    keep = np.array([t not in SPECIALS for t in tokens])
    result = []
    for row in mean:
        order = [j for j in np.argsort(-row, kind="stable") if keep[j]][:n]
        result.append([(tokens[j], int(j), float(row[j])) for j in order])
    return result


def key_label(tokens: list[str], j: int) -> str:
    """``tokens[j]``, with ``@j`` added when that token occurs more than once in the text.

    >>> key_label(["[CLS]", "the", "cat", "saw", "the", "dog"], 4), key_label(["the", "cat"], 1)
    ('the@4', 'cat')
    """
    return f"{tokens[j]}@{j}" if tokens.count(tokens[j]) > 1 else tokens[j]


def explain(text: str = DEFAULT_TEXT, *, model=None, token: str = "it", top: int = 3) -> dict:
    """Run ``text`` through a BERT-family encoder on qkv's attention.

    ``model`` is a loaded :class:`qkv.models.Bert`, a folder path, a Hugging Face model id,
    or None for all-MiniLM-L6-v2 (see :func:`qkv.models.load_bert`). Texts past the
    model's limit are cut with a warning.

    Returns a dict: ``tokens`` (T word pieces), ``attentions`` ``(layers, heads, T, T)``,
    ``index`` (position of ``token``), ``top`` (per layer, the ``top`` keys it weights most,
    ``[(token, position, weight), ...]``, specials left out), ``special_share`` (per layer, the
    weight it puts on [CLS]/[SEP], mean over heads) and ``model``.
    """
    from ..errors import positive_int
    from ..models import Bert, load_bert

    if not isinstance(text, str) or not text.strip():
        raise ShapeError("text must not be empty: give a sentence, or leave it out for the default one")
    top = positive_int("top", top)
    bert = model if isinstance(model, Bert) else load_bert(model)
    tokens, att = bert.attentions(text)
    i = find_token(bert, tokens, token)
    special = np.array([t in SPECIALS for t in tokens])
    share = att[:, :, i][..., special].sum(axis=-1).mean(axis=-1)  # (L, H, T) -> (L, H) -> (L,)
    return {"tokens": tokens, "attentions": att, "index": i, "top": top_keys(att, tokens, i, top),
            "special_share": [float(x) for x in share], "model": bert}
