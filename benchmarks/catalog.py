"""The suites of ``qkv bench``: one line each, the registry ``--suite`` and ``--help`` are made from."""

# name -> one line; SUITES (suites.py) is its keys, in this order.
SUITE_HELP = {
    "main": "one long sequence (B=1 H=8 T=4096 D=64): qkv's tiled attention against dense NumPy and torch SDPA",
    "sweep": "the same against T, 512 to 16384: time and memory",
    "decode": "one decoding step against a KV cache",
    "encoder": "the pretrained encoder (all-MiniLM-L6-v2) against sentence-transformers",
    "torch": "qkv.torch's custom ops against SDPA, forward and backward",
    "ring": "ring attention over MPI ranks (mpiexec -n W) against one process",
    "gpt": "qkv train gpt's step against a plain PyTorch GPT of nanoGPT's CPU recipe",
    "shapes": "training and serving shapes (short T, many batch items and heads) against torch",
    "train-mpi": "data and context parallel GPT training over MPI ranks (mpiexec -n W)",
    "hf": "transformers models with qkv's attention registered against their own",
    "cold": "the first call's cost (imports, compiling) against later calls",
    "recurrent": "the recurrences (decay, delta rule, DPLR) against transformers' and fla's torch forms",
    "hybrid": "GPTs of each layer pattern (jamba, qwen3-next, griffin, ...) trained side by side: loss and ms a step",
    "hybrid-decode": "decoding with those hybrid models: states and caches, ms a token",
    "hf-hybrid": "transformers' hybrid models (Qwen3-Next-, Mamba-2-, Kimi-like) on qkv's recurrent kernels against their torch fallbacks",
}
