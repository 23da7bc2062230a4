"""SkyMesh: a cross-region, KV-cache-aware load balancer for LLM inference."""

__version__ = "0.1.0"
