"""The lab beside the product: simulator, emulated engine and replica, workloads,
benchmarks, experiments, fault harness, demos. The product (``skymesh``) never imports it."""
