"""`certkv serve`: an OpenAI-shaped HTTP service for a certified operating point.

:mod:`certkv.serve.schemas` (request shapes, and the rule that splits a plain prompt into context
and question), :mod:`certkv.serve.responses` (typed response shapes), :mod:`certkv.serve.scheduler`
(admission under the KV budget and batched decoding, no HTTP), :mod:`certkv.serve.service` (the
scheduler, the live monitor and its shadows around one model), :mod:`certkv.serve.metrics`
(Prometheus metrics, prefixed ``certkv_``), :mod:`certkv.serve.routes` (the endpoints),
:mod:`certkv.serve.streaming` (server-sent events), :mod:`certkv.serve.middleware` (API key, body
limit) and :mod:`certkv.serve.app` (the ASGI app that puts them together). ``certkv serve --replicas``
adds :mod:`certkv.serve.replicas` (the Ray Serve deployment), :mod:`certkv.serve.shared_monitor`
(the one monitor of every replica, a Ray actor), :mod:`certkv.serve.monitor_client` (a replica's side
of it) and :mod:`certkv.serve.monitor_journal` (what restores it). Nothing here is imported by the rest
of certkv except the ``serve`` command.
"""
