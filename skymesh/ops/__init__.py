"""Operator clients: ``skymesh ctl`` (the admin API) and ``skymesh dns``."""
