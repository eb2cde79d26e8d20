"""``certkv gateway``: an endpoint contract's operating point deployed in front of its servers.

:mod:`certkv.gateway.upstream` (one OpenAI-compatible server: pooled calls under timeouts, its
health), :mod:`certkv.gateway.gateway` (where a request goes, the gate, the monitor and its
shadows), :mod:`certkv.gateway.app` (the routes, on ``certkv serve``'s schemas, errors, streams
and metrics) and :mod:`certkv.gateway.setup` (the point, its contract's endpoints, the monitor).
Torch-free: nothing here loads a model. Nothing here is imported by the rest of certkv except the
``gateway`` command.
"""
