"""``skymesh-lb``: the regional balancer (data path, admission queue, replica state)."""
