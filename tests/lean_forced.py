"""``pytest -p lean_forced``: every server this run starts in-process through
skymesh.net.serving serves with ``http_server="lean"`` (skymesh.net.lean), so a test file
written for aiohttp's server checks the lean server's behaviour unchanged. The default is
patched on the functions themselves: test modules import them by name before any fixture
runs."""

from __future__ import annotations

from skymesh.net import serving


def _lean_default(fn: object) -> None:
    code = fn.__code__  # type: ignore[attr-defined]
    names = code.co_varnames[:code.co_argcount]
    defaults = list(fn.__defaults__)  # type: ignore[attr-defined]
    defaults[names.index("http_server") - (len(names) - len(defaults))] = "lean"
    fn.__defaults__ = tuple(defaults)  # type: ignore[attr-defined]


_lean_default(serving.start_app)
_lean_default(serving.serve_app)
