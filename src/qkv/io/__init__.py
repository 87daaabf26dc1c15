"""Files in and out: what a checkpoint, a training run and other projects' files are made of.

Every reader here checks a file's claims (sizes, shapes, types, finiteness) before believing
them, and every writer writes atomically and never replaces what qkv did not make.

================  ===========================================================================
module            what it reads or writes
================  ===========================================================================
``checkpoint``    a Hugging Face BERT-family folder: config.json, every tensor by name
``bert_files``    :func:`load_bert`: that folder (or a hub id, or the default) as a ``Bert``
``locate``        where a model's files are: a folder, a hub id, the offline all-MiniLM-L6-v2
``gpt_files``     qkv's own GPT folder (``GPT.save``, :func:`load_gpt`) and GPT-2's (:func:`load_gpt2`)
``tensorfiles``   safetensors written whole (a temporary file, then a rename)
``runfiles``      a training run's folder (``qkv train gpt --out``): weights, optimizer, log
``runsave``       a save of several files that is atomic as a whole
``nanogpt``       nanoGPT's ``state_dict`` names, one explicit table to and from qkv's
``nanoconfig``    nanoGPT's config files and ``--name=value`` overrides, read as data
``convert``       ``qkv convert``: nanoGPT's ``ckpt.pt`` to a run folder and back, a GPT to GPT-2's
================  ===========================================================================

The networks these files fill are :mod:`qkv.models`'; the loop that writes a run is
:mod:`qkv.training`'s. Importing this package costs nothing: each module imports its own.
"""
