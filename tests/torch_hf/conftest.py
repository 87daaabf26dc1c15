"""PyTorch and Hugging Face: qkv.torch's operators, modules and the transformers hook, against torch and transformers. (Not named ``torch``: tests/ is on sys.path, and an empty ``torch`` folder there would pass for the package.)

Shared helpers (helpers.py, oracle.py, recurrent_hf.py, ...) are in tests/ (its conftest)."""
