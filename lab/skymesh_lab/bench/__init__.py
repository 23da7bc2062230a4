"""Benchmarks that check SkyMesh against itself and against references."""
