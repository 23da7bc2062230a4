"""Observability shared by ``skymesh-lb`` and ``skymesh-controller``.

* :mod:`skymesh.obs.logs`: ``--log-format text|json`` (a stdlib ``logging.Formatter``).
* :mod:`skymesh.obs.access`: one ``skymesh.access`` line per request through skymesh-lb
  (an aiohttp middleware the balancer fills in with :func:`~skymesh.obs.access.note`).
* :mod:`skymesh.obs.asgi`: the same for the controller (a pure ASGI middleware).
* :mod:`skymesh.obs.tracing`: OpenTelemetry spans, off unless ``tracing.otlp_endpoint``
  is set; the SDK is imported only then (the ``tracing`` extra).
* :mod:`skymesh.obs.config`: the ``logging:`` and ``tracing:`` config sections.

Nothing here imports OpenTelemetry at module level: the lean balancer install lacks it.
"""
