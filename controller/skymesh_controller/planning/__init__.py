"""Capacity planning: demand series, forecasters, instance need, the ILP and scaling strategies."""
