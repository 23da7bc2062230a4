"""Planning experiments: the simulated capacity week, its diagnosis, forecast evaluation
and engine-derived capacities."""
