"""`certkv serve`: an OpenAI-shaped HTTP service for a certified operating point.

:mod:`certkv.serve.schemas` (request and response shapes, and the rule that splits a plain prompt
into context and question), :mod:`certkv.serve.service` (one model replica behind a bounded queue,
one worker thread running live requests and, at lower priority, the live monitor's shadows),
:mod:`certkv.serve.metrics` (Prometheus metrics, prefixed ``certkv_``) and :mod:`certkv.serve.app`
(the FastAPI app: endpoints, API key, body limit, OpenAI-shaped errors). Nothing here is imported
by the rest of certkv except the ``serve`` command.
"""
