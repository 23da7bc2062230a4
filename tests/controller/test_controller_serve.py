"""The socket the controller binds itself (skymesh_controller.serve)."""

from __future__ import annotations

import asyncio
import socket

from skymesh_controller.serve import _bind


async def test_connections_on_the_controllers_socket_have_nagle_off() -> None:
    """asyncio turns Nagle off only on connections accepted from a socket made with
    ``IPPROTO_TCP``. With Nagle on, a response uvicorn writes in two parts (head, then
    body) waited for the client's delayed ACK: a healthy admin client's p50 was about
    40 ms on loopback instead of 1 ms (found by the security page's figures)."""
    loop = asyncio.get_running_loop()
    nodelay: asyncio.Future[int] = loop.create_future()

    class Accepted(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    sock = _bind("127.0.0.1", 0)
    server = await loop.create_server(Accepted, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(nodelay, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
