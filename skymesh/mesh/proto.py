"""The generated peering messages and stubs, generated first if missing or stale.

Import messages from here (``from skymesh.mesh.proto import pb``), never from
``skymesh.mesh.gen`` directly: this module is what guarantees the stubs exist.
"""

from __future__ import annotations

from skymesh.mesh.codegen import ensure_stubs

ensure_stubs()

from skymesh.mesh.gen.skymesh.v1 import peering_pb2 as pb  # noqa: E402
from skymesh.mesh.gen.skymesh.v1 import peering_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
