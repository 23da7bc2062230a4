"""The URL policy's aiohttp resolver (:mod:`skymesh.net.urlpolicy`), in a module of its
own: the policy's checks are also what the balancer's config runs, in the workers'
supervisor too, which never connects anywhere and need not load aiohttp."""

from __future__ import annotations

import socket

from aiohttp.abc import AbstractResolver, ResolveResult

from skymesh.net.urlpolicy import Resolver, UrlPolicy, resolve_checked, system_resolver


class PolicyResolver(AbstractResolver):
    """An aiohttp resolver that refuses hosts resolving to addresses the policy denies.

    Pass it as ``aiohttp.TCPConnector(resolver=PolicyResolver(policy))``: aiohttp calls it
    for every DNS name it connects to (IP literals bypass resolvers: check those with
    :func:`skymesh.net.urlpolicy.check_static` before the request)."""

    def __init__(self, policy: UrlPolicy, resolver: Resolver = system_resolver) -> None:
        self.policy, self.resolver = policy, resolver

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET
                      ) -> list[ResolveResult]:
        ips = await resolve_checked(host, port, self.policy, self.resolver)
        return [ResolveResult(hostname=host, host=str(ip), port=port,
                              family=socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                              proto=0, flags=socket.AI_NUMERICHOST) for ip in ips]

    async def close(self) -> None:
        return None
