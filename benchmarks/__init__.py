"""qkv's benchmark suite, installed with qkv as the package ``qkv_benchmarks``; ``qkv bench`` runs it.

Every case runs its methods on the same inputs, alternating them repeat by repeat, and
reports medians, with the peer measured in the same run. The modules, each one thing:

- ``suites``: the suites and their sizes; ``plan(...)`` and ``run_suites(plan, progress)``
  return every measurement as a dict (what ``--json`` writes);
- ``attention``: one attention case: inputs, the callables of qkv, dense NumPy and torch,
  the FLOP and byte formulas, the copy peer of decoding;
- ``timing``: the one timing loop (alternating, warm-up, medians of wall and CPU time);
- ``memory``: peak extra memory of a call (the resident-set high-water mark), in fresh processes;
- ``encoder``: qkv's MiniLM encoder against sentence-transformers;
- ``torch_suite``: ``qkv.torch.attention`` against qkv on NumPy and PyTorch SDPA (``--suite torch``);
- ``shapes_suite``: qkv (``method="auto"``) against SDPA at training and serving shapes (``--suite shapes``);
- ``hf_suite``: a small Hugging Face decoder on attn_implementation "qkv" against "sdpa" and "eager" (``--suite hf``);
- ``ring``: ring attention over MPI against one process (``mpiexec -n W qkv bench --suite ring``);
- ``machine``: the CPU's vector level as NumPy uses it, the BLAS and its kernel, the exp path;
- ``report``: the header, the tables (as data) and the sweep plot (a matplotlib Figure).
- ``hybrid_suite``: the GPT's layer patterns trained on nanoGPT's CPU recipe (``--suite hybrid``) and one
  cached decoding step at 1k to 64k tokens of context (``--suite hybrid-decode``); ``hybrid_report``: their tables;
- ``table``: the ``Table`` every report draws (text or Markdown).

No module here prints, parses arguments or imports a terminal library: that is ``qkv.cli.bench``.
"""
