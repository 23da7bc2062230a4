"""``skymesh-replica``: an emulated GPU replica behind a vLLM/SGLang-compatible HTTP API.

:mod:`.driver` runs the clock-free engine in real time, :mod:`.server` is the aiohttp app,
:mod:`.metrics` the Prometheus exposition and :mod:`.cli` the command line.
"""

from skymesh_replica.driver import ContextLengthError, RealtimeDriver, RequestHandle
from skymesh_replica.server import ReplicaConfig, create_app

__all__ = ["ContextLengthError", "RealtimeDriver", "ReplicaConfig", "RequestHandle",
           "create_app"]
