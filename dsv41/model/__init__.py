"""The model's floor: one class per block, built from ``(cfg, weights)``.

Each block owns its checkpoint tensors (names, shapes, formats), its cache names and its stage math;
``Transformer.forward`` composes them into the reference forward, and the graph's Torch kernels
(``dsv41.kernels.nodes``) call the same stage methods on a card's weight shards. Blocks hold no
state of a run: weights are looked up in the mapping they were built with, caches are passed in.
"""
