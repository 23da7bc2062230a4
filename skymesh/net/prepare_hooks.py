"""Which of an app's ``on_response_prepare`` hooks a whole reply needs.

A hook that only watches streamed bodies (the access log's) does nothing for a whole
reply; the lean server's direct writes (:meth:`skymesh.net.lean.LeanProtocol._send_plain`)
leave such hooks out, decided once per app, rather than call and await them per reply.
A module of its own: the access log marks its hook here and the lean server reads the
mark, neither importing the other's module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

PrepareHook = Callable[[Any, web.StreamResponse], Awaitable[object]]
_STREAMS_ONLY = "skymesh_streams_only"  # the mark streams_only() sets on a hook
_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def streams_only(hook: _Hook) -> _Hook:
    """Mark an ``on_response_prepare`` hook that does nothing for a whole reply (a
    ``web.Response``): :func:`plain_prepare_hooks` leaves it out. aiohttp's own server
    still calls it: it must stay harmless for one."""
    setattr(hook, _STREAMS_ONLY, True)  # a method's: set on its function, read through
    return hook


def plain_prepare_hooks(app: web.Application) -> tuple[PrepareHook, ...]:
    """``app``'s ``on_response_prepare`` hooks a whole reply needs: all but those marked
    :func:`streams_only`, in their order (the app frozen: its hooks are final)."""
    return tuple(hook for hook in app.on_response_prepare
                 if not getattr(hook, _STREAMS_ONLY, False))
