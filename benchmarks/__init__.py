"""qkv's benchmark suite, installed with qkv as the package ``qkv_benchmarks``.

``attention``: the tiled kernel against dense NumPy and PyTorch SDPA (``qkv bench``).
``encoder``: the BERT encoder against sentence-transformers (``python benchmarks/encoder.py``).
"""
