"""``skymesh demo``: the local three-region mesh and its mesh variant."""
