"""The prefix cache below the KV pool: blocks the pool evicts spill to host memory, then to disk,
and come back on a hit (docs/prefix-caching.md#tiers).

- ``entry.py``: what a stored block is (its key, tokens, chain facts, payload) and the disk
  file's fixed binary layout, with its checks.
- ``fingerprint.py``: what makes two engines' KV bytes interchangeable.
- ``store.py``: the host and disk tiers (index and data), owned by the KV cache manager.
- ``transfer.py``: the model runner's part: a block's bytes out of and into the cache tensors.
"""
