"""The SkyMesh controller: admin API, durable state, health probing and failover.

Never on a request's path: balancers keep serving with the membership they last received
when the controller is down or restarting.
"""
