"""``pytest -p aiohttp_forced``: every server this run starts in-process through
skymesh.net.serving serves with ``http_server="aiohttp"`` (aiohttp's server alone, the
option an operator can still pick), so a test file written against the default (the lean
server, skymesh.net.lean) checks aiohttp's server's behaviour unchanged. The default is
patched on the functions themselves: test modules import them by name before any fixture
runs."""

from __future__ import annotations

from skymesh.net import serving


def _aiohttp_default(fn: object) -> None:
    code = fn.__code__  # type: ignore[attr-defined]
    names = code.co_varnames[:code.co_argcount]
    defaults = list(fn.__defaults__)  # type: ignore[attr-defined]
    defaults[names.index("http_server") - (len(names) - len(defaults))] = "aiohttp"
    fn.__defaults__ = tuple(defaults)  # type: ignore[attr-defined]


_aiohttp_default(serving.start_app)
_aiohttp_default(serving.serve_app)
