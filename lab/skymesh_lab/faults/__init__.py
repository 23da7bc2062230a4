"""Fault injection, accounting and soak for SkyMesh (the ``[hardening]`` suite).

Modules: :mod:`.cluster` (starting replicas, balancers, a controller, Redis and the
three-region mesh as real local processes), :mod:`.client` (a client that classifies
every request it sends), :mod:`.scenarios` (one function per fault), :mod:`.runner`
(runs them, prints the table, writes the contract JSON), :mod:`.cli`
(``skymesh faults run``) and :mod:`.soak` (``make soak``).
"""
