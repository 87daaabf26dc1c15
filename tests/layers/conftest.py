"""Layers and models: qkv.nn's layers and caches, the GPT and its training, the encoder and its checkpoints.

Shared helpers (helpers.py, oracle.py, recurrent_hf.py, ...) are in tests/ (its conftest)."""
