"""The autopilot: a planner inside the controller (telemetry -> forecast -> ILP -> actuator).

Layout (docs/autopilot.md): ``config`` (the ``planner:`` section), ``decide`` (pure: series,
forecasts, the ILP's input, the diff), ``guard`` (pure: cooldowns against flapping),
``actuators`` (the configured actuator behind one seam), ``moves`` (drain, wait,
re-register a replica the plan moves), ``planner`` (the loop and the records),
``strategy`` (between rounds), ``metrics`` (its /metrics series), ``routes``
(``/v1/plans``). The controller imports ``config`` and ``routes`` only; ``planner``, and
with it the ILP solver, loads when a ``planner:`` section is configured.
"""
