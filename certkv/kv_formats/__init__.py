"""KV formats: the precision a candidate stores its keys and values at (the second axis).

:mod:`~certkv.kv_formats.spec` (torch-free) validates, names and prices formats as a contract
writes them; :mod:`~certkv.kv_formats.token_quantisers` and :mod:`~certkv.kv_formats.caches` build
the caches that store them (transformers' ``QuantizedCache`` and certkv's per-token formats).
"""
