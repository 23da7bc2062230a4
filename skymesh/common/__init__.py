"""The kernel both planes share: config base and YAML loading (:mod:`.config`), replica
probe parsing (:mod:`.probe`) and the health rule (:mod:`.health`).

``skymesh-lb`` and ``skymesh-controller`` import these; neither plane reaches into the
other's private modules. Together with :mod:`skymesh.net` (URL policy, connection limits,
serving), :mod:`skymesh.obs` and :mod:`skymesh.util` this is all the control plane takes
from the data plane's package, bar the policy registry it validates configs against.
"""
