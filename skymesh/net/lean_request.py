"""The request and body objects of the lean server (:mod:`skymesh.net.lean`).

:class:`LeanRequest` carries what the app's plain-route handlers, the access log, the
connection guard and aiohttp's ``web.Response.prepare()`` read of a ``web.Request``, and
nothing else: the lean server takes only requests to the app's plain routes (no query
string, no ``Expect``, no ``Transfer-Encoding``), so what a request of another kind would
need (a query, a multipart body, a match on a dynamic path) is never asked for here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import ChainMapProxy
from aiohttp.http_writer import HttpVersion, StreamWriter
from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy
from yarl import URL

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import UrlMappingMatchInfo

# A request body buffered past this pauses reading until the handler takes it: the server
# never holds more than this (plus one read) of a body the handler does not read.
BODY_HIGH_WATER = 256 * 1024
_EMPTY_QUERY: MultiDictProxy[str] = MultiDictProxy(MultiDict())


class LeanBody:
    """A request body as the handlers read it (aiohttp's ``StreamReader`` methods they
    call): fed by the protocol's parser, bounded by pausing the transport's reading."""

    __slots__ = ("_buf", "_eof", "_exc", "_pause", "_size", "_waiter")

    def __init__(self, pause: Any) -> None:
        # A list, not a deque: it is mostly one chunk, taken whole; a deque is 760 bytes
        # (and a block of 64 slots) per request, an empty list 56.
        self._buf: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._pause = pause  # pause(bool): the protocol holds or frees the transport

    # -- from the protocol -------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size > BODY_HIGH_WATER:
            self._pause(True)
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- what the handlers call ----------------------------------------------------------
    def is_eof(self) -> bool:
        """The whole body has arrived (maybe not read yet), as aiohttp's."""
        return self._eof

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def read_nowait(self, n: int = -1) -> bytes:
        if self._exc is not None:
            raise self._exc
        if n >= 0 and self._buf and len(self._buf[0]) > n:
            head = self._buf[0]
            self._buf[0] = head[n:]
            data = head[:n]
        else:
            data = b"".join(self._buf)
            self._buf.clear()
        self._size -= len(data)
        if self._size <= BODY_HIGH_WATER:
            self._pause(False)
        return data

    async def readany(self) -> bytes:
        while not self._buf and not self._eof:
            if self._exc is not None:
                raise self._exc
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if not self._buf:
            return b""
        data = self._buf.pop(0)  # a few chunks at most: the body is bounded above
        self._size -= len(data)
        if self._size <= BODY_HIGH_WATER:
            self._pause(False)
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk


class LeanRequest:
    """One request on a plain route, as its handler and ``web.Response`` see it."""

    __slots__ = ("_content_length", "_match_info", "_protocol", "_rel_url", "_state",
                 "_writer", "app", "content", "headers", "keep_alive", "method", "path",
                 "raw_path", "remote", "task", "transport", "version")

    def __init__(self, app: web.Application, method: str, raw_path: str,
                 headers: CIMultiDictProxy[str], version: HttpVersion, keep_alive: bool,
                 content: LeanBody, protocol: BaseProtocol, transport: asyncio.Transport,
                 remote: str | None, task: asyncio.Task[None] | None) -> None:
        self.app = app
        self.method = method
        self.raw_path = self.path = raw_path  # a plain route's path: no escapes in it
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.content = content
        self._protocol = protocol
        self._writer: StreamWriter | None = None  # made when a response is prepared
        self.transport = transport
        self.remote = remote
        self.task = task
        self._state: dict[Any, Any] = {}
        self._match_info: UrlMappingMatchInfo | None = None
        self._rel_url: URL | None = None
        self._content_length: int | None = -1  # -1: not parsed yet

    # -- the request's storage (web.Request is a MutableMapping) ------------------------
    def __getitem__(self, key: Any) -> Any:
        return self._state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._state[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._state[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._state.get(key, default)

    @property
    def _payload_writer(self) -> StreamWriter:
        """What ``web.StreamResponse.prepare()`` writes through; the lean server's plain
        answers are written without one, so it is made only for the others."""
        writer = self._writer
        if writer is None:
            writer = self._writer = StreamWriter(self._protocol, self._protocol._loop)
        return writer

    @property
    def output_size(self) -> int:
        """Bytes of a response written through ``_payload_writer`` (0: none started)."""
        return self._writer.output_size if self._writer is not None else 0

    # -- what aiohttp's Request derives ----------------------------------------------------
    @property
    def match_info(self) -> UrlMappingMatchInfo:
        assert self._match_info is not None  # set by skymesh.net.front before the handler
        return self._match_info

    @property
    def config_dict(self) -> ChainMapProxy:
        apps = self.match_info.apps
        return ChainMapProxy(list(reversed(apps[:apps.index(self.app) + 1])))

    @property
    def rel_url(self) -> URL:
        if self._rel_url is None:
            self._rel_url = URL.build(path=self.raw_path, encoded=True)
        return self._rel_url

    @property
    def query(self) -> MultiDictProxy[str]:
        return _EMPTY_QUERY  # a query string is aiohttp's to serve

    @property
    def query_string(self) -> str:
        return ""

    @property
    def secure(self) -> bool:
        return self.transport.get_extra_info("sslcontext") is not None

    @property
    def scheme(self) -> str:
        return "https" if self.secure else "http"

    @property
    def host(self) -> str:
        return self.headers.get("Host") or "localhost"

    @property
    def url(self) -> URL:
        return URL.build(scheme=self.scheme, authority=self.host, path=self.raw_path,
                         encoded=True)

    @property
    def content_length(self) -> int | None:
        length = self._content_length
        if length == -1:  # parsed once: the body limit and body_exists both ask
            value = self.headers.get("Content-Length")
            # The parser checked the digits.
            length = self._content_length = int(value) if value is not None else None
        return length

    @property
    def can_read_body(self) -> bool:
        return not self.content.at_eof()

    @property
    def body_exists(self) -> bool:
        return self.content_length not in (None, 0)

    async def read(self) -> bytes:
        return await self.content.read()

    async def text(self) -> str:
        return (await self.read()).decode("utf-8")

    async def json(self, *, loads: Any = json.loads) -> Any:
        return loads(await self.text())

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        # What web.Request does: the on_response_prepare signals of the route's apps.
        match_info = self._match_info
        if match_info is None:
            return
        for app in match_info.apps:
            if on_prepare := app.on_response_prepare:
                await on_prepare.send(cast(web.Request, self), response)


__all__ = ["BODY_HIGH_WATER", "LeanBody", "LeanRequest"]
