"""Strict JSON request bodies: one parser for skymesh-lb and skymesh-replica.

``json.loads`` accepts more than JSON and fails in more ways than ``JSONDecodeError``:

- ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259 section 6), and a
  number too large for a float (``1e999``) quietly becomes ``inf``: both are refused, so
  no engine downstream sees a non-finite temperature or penalty;
- an integer of more than ``sys.get_int_max_str_digits()`` (4,300) digits raises a bare
  ``ValueError``;
- nesting deeper than the C scanner's recursion limit raises ``RecursionError``;
- invalid UTF-8 raises ``UnicodeDecodeError``.

:func:`loads_body` turns every one of these into :class:`JsonBodyError`, which each
server maps to its 400. Bodies are decoded as UTF-8 only (RFC 8259 section 8.1), not
UTF-16/32 as ``json.loads`` would guess from the first bytes.

Speed: msgspec, when installed (the ``fast`` extra, as the balancer's image has it),
parses a body first (2-5x faster than ``json``; figures in docs/notes/memory-1m.md).
What it refuses goes to the ``json`` decoder, so what is
accepted and every error message stay those of ``json``: msgspec refuses all that ``json``
refuses here and more (lone surrogates in ``\\u`` escapes, which ``json`` takes), and
where both accept a body they give the same value (integers of any size stay exact;
tests/unit/test_jsonbody.py checks it). orjson was measured too and not taken: it turns
an integer past 64 bits into a float, and telling such bodies apart cost more than it
saved.
"""

from __future__ import annotations

import json
import math
from typing import Any


class JsonBodyError(ValueError):
    """The body is not a JSON text we accept; the message says why, for the client."""


def _no_constant(name: str) -> Any:
    raise JsonBodyError(f"{name} is not a JSON value; send a finite number or null")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonBodyError(f"number {text[:40]!r} is out of range for a double")
    return value


# One decoder for the process: json.loads(..., parse_constant=...) would build a new one
# (and its C scanner) per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


_FAST: Any = None
_FAST_USAGE: Any = None
# What msgspec raises for a body it does not take (ValueError: bad UTF-8 in a string).
_REFUSED: tuple[type[BaseException], ...] = ()
try:
    import msgspec

    class _UsageOnly(msgspec.Struct):
        """A reply's top-level ``usage``; msgspec skips the other fields unbuilt."""

        usage: Any = None

    _FAST = msgspec.json.Decoder()
    _FAST_USAGE = msgspec.json.Decoder(_UsageOnly)
    _REFUSED = (msgspec.MsgspecError, ValueError, RecursionError)
except ImportError:  # the lean core (no ``fast`` extra): json alone
    pass


NOT_DECODED = object()  # fast_decode's "ask json"


def fast_decode(raw: bytes) -> Any:
    """``raw`` decoded by msgspec, or :data:`NOT_DECODED` when msgspec is not installed or
    does not take it (then ``json`` has the last word, as in :func:`loads_body`)."""
    if _FAST is None:
        return NOT_DECODED
    try:
        return _FAST.decode(raw)
    except _REFUSED:
        return NOT_DECODED


def fast_usage(raw: bytes) -> Any:
    """The ``usage`` member of the JSON object in ``raw`` (None without one), decoded by
    msgspec without building the rest of the object (a quarter of the whole decode on a
    short chat reply); :data:`NOT_DECODED` when msgspec is not installed or does not take
    ``raw`` (not an object, not JSON): the caller then parses it whole."""
    if _FAST_USAGE is None:
        return NOT_DECODED
    try:
        return _FAST_USAGE.decode(raw).usage
    except _REFUSED:
        return NOT_DECODED


def loads_body(raw: bytes) -> Any:
    """The JSON value in ``raw``; :class:`JsonBodyError` for anything else."""
    value = fast_decode(raw)
    return value if value is not NOT_DECODED else loads_strict(raw)


def loads_strict(raw: bytes) -> Any:
    """:func:`loads_body` with the ``json`` decoder alone (its reference behaviour)."""
    try:
        return _DECODER.decode(raw.decode("utf-8"))
    except JsonBodyError:
        raise
    except UnicodeDecodeError as exc:
        raise JsonBodyError(f"request body is not valid UTF-8: {exc.reason} at byte "
                            f"{exc.start}") from None
    except json.JSONDecodeError as exc:
        raise JsonBodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the scanner recurses once per nesting level
        raise JsonBodyError("request body is nested too deeply") from None
    except ValueError as exc:  # int('9' * 5000): Python's digit limit for int parsing
        raise JsonBodyError(f"request body holds a number json cannot take: {exc}") from None


__all__ = ["NOT_DECODED", "JsonBodyError", "fast_decode", "fast_usage", "loads_body",
           "loads_strict"]
