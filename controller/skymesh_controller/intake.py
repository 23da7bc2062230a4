"""The admin API's door for request bodies: who may send one, how large, which encoding.

A pure ASGI middleware in front of FastAPI. FastAPI reads a route's whole body before it
resolves the route's token dependency, and a chunked body has no Content-Length to check
first, so without this door anyone could make the controller hold any number of bytes:

- a request that carries a body (Content-Length above 0, or chunked) needs a bearer token
  the token book knows before one byte of it is read: 401 otherwise;
- the body is read here and counted as it streams: 413 once past ``max_body_bytes`` (a
  Content-Length over it is refused before reading);
- JSON is UTF-8 (RFC 8259, section 8.1): a body that is not, or that holds a NUL byte
  (UTF-16 or UTF-32 text, whose encoding ``json.loads`` would otherwise guess), is a 400.

A refusal closes the connection (``Connection: close``), so the server does not go on
reading a body nobody wants. An accepted body is replayed to the app in one message.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from skymesh.obs.asgi import App, Message, Receive, Scope, Send

UNAUTHENTICATED, TOO_LARGE, NOT_UTF8 = "unauthenticated_body", "body_too_large", "not_utf8"


def bearer(scope: Scope) -> str | None:
    """The bearer token of the request's Authorization header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return (token.strip() or None) if scheme.lower() == "bearer" else None
    return None


def has_body(scope: Scope) -> tuple[bool, int | None]:
    """(whether a body follows the headers, its announced length when one is given)."""
    length: int | None = None
    chunked = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            length = int(text) if text.isdigit() else -1
        elif name == b"transfer-encoding":
            chunked = chunked or b"chunked" in value.lower()
    return chunked or (length is not None and length != 0), length


class BodyGate:
    """Wraps the app; ``known(token)`` says whether a token is valid, ``refused(reason)``
    is told of each refusal (a count and a log line)."""

    def __init__(self, app: App, *, known: Callable[[str], bool], max_bytes: int,
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.known, self.max_bytes, self.refused = app, known, max_bytes, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_follows, length = has_body(scope)
        if not body_follows:
            await self.app(scope, receive, send)
            return
        token = bearer(scope)
        if token is None or not self.known(token):
            await self._refuse(send, UNAUTHENTICATED, 401, "unauthorized",
                               "a valid bearer token is required")
            return
        if length is not None and not 0 <= length <= self.max_bytes:
            await self._refuse(send, TOO_LARGE, 413, "too_large",
                               f"body over {self.max_bytes} bytes")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(send, TOO_LARGE, 413, "too_large",
                                   f"body over {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        if b"\x00" in body or not _utf8(body):
            await self._refuse(send, NOT_UTF8, 400, "invalid_body",
                               "the body must be JSON text in UTF-8")
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _refuse(self, send: Send, reason: str, status: int, kind: str,
                      message: str) -> None:
        self.refused(reason)
        payload = json.dumps({"error": {"type": kind, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _utf8(data: bytearray) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay
