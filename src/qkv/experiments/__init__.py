"""The texts' experiments as library functions that return data (and draw pictures on request).

Nothing here prints or parses arguments: the ``qkv`` command (:mod:`qkv.cli`) does that.

- :mod:`~qkv.experiments.worked`: the texts' hand-worked examples recomputed and checked;
- :mod:`~qkv.experiments.scale`: why scores are divided by √d_k, measured;
- :mod:`~qkv.experiments.lookup`: the soft dictionary lookup, learned end to end with :mod:`qkv.nn`;
- :mod:`~qkv.experiments.explain`: what a real pretrained encoder attends to;
- :mod:`~qkv.experiments.complexity`: time and memory against T of dense, tiled, chunked
  and linear attention, and decoding cost (its table and picture in ``complexity_report``);
- :mod:`~qkv.experiments.recall`: the lookup learned by softmax and by linear attention as
  the number of pairs grows;
- :mod:`~qkv.experiments.mqar`: Zoology's multi-query associative recall on 2-layer GPTs of
  each mixer and attention hybrids (its task in ``mqar_data``, its table and picture in
  ``mqar_report``).

Import the one you need (``from qkv.experiments import lookup``); none is imported by ``import qkv``.
"""
