"""Parts of the access log switched off in a live skymesh-lb, to find where its cost goes.

``access_log_cost --ablate`` runs extra skymesh-lb daemons with a ``sitecustomize.py``
on their ``PYTHONPATH`` that calls :func:`apply` before anything else: the product has
no switch for this, and the patches replace methods of the revision the bench runs
(``skymesh.obs.access``), so they follow that code and are meaningful only against it.
Each variant runs with the access log on and is compared with the same build started
with ``--no-access-log``, as the full log is.

Variants:

``record``
    The request's record, the wrapper around the app, the balancer's notes and the
    prepare hook; at the request's end the record gets its last fields, then nothing:
    no line made, nothing queued, no batch.
``lines``
    That, and batches as in the daemon with their lines made on the loop, then
    discarded: nothing written.
``thread``
    The full log, its batches handed to the writer thread to write even where the loop
    would write them itself (a pipe's since ``skymesh.obs.logsink``; a regular file's,
    the benchmark's stderr, only in ``ba4e56e``, the checkout its committed run
    measured: later ones hand a file's batches to the thread anyway).

``tlines``
    The full log with each batch's lines made in the writer thread instead of on the
    loop: the loop hands the thread the batch's finished records (a file's batches;
    a pipe's, which the loop writes itself, stay on the loop). What issue #35 asked to
    measure: the formatting off the loop, against the thread's own CPU for it.

``floor``
    The least a log made in Python on the loop does for the benchmark's requests
    (:mod:`skymesh_lab.bench.access_log_floor`): the same line for a whole reply, a
    list per request and one tuple per line, written as the full log writes.
    ``floor-nonotes``: the same with the balancer's three notes returning at once;
    ``floor-nolines``: with each batch dropped rather than made and written.

The full log is the build itself (no patch).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

VARIANTS = ("record", "lines", "thread", "tlines", "floor", "floor-nonotes", "floor-nolines")


def apply(variant: str) -> None:
    """Patch ``skymesh.obs.access`` of this process for ``variant`` (see the module)."""
    from skymesh.obs import access

    writer_cls: Any = access.AccessWriter
    if variant == "record":
        def put(self: Any, what: Any, body: Any) -> bool:
            return self._thread is not None  # taken, and forgotten

        writer_cls.put = put
    elif variant == "lines":
        def flush(self: Any) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            items, self.pending = self.pending, []
            if items and self._handler is not None:
                "".join(self._lines(self._handler, items)).encode()

        writer_cls.flush = flush
    elif variant == "thread":
        access.open_sink = lambda *args, **kwargs: None
    elif variant.startswith("floor"):
        from skymesh_lab.bench import access_log_floor

        access_log_floor.apply(notes=variant != "floor-nonotes",
                               lines=variant != "floor-nolines")
    elif variant == "tlines":
        plain_flush, plain_write = writer_cls.flush, writer_cls._write

        def flush_records(self: Any) -> None:
            if self._sink is not None:  # the loop's own sink: as the build does
                plain_flush(self)
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            items, self.pending = self.pending, []
            if items and self._handler is not None:
                self._queue.put((self._handler, items))  # the records, not their lines

        def write_records(self: Any, entries: list[Any]) -> None:
            made = []
            for entry in entries:
                if len(entry) == 2 and type(entry[1]) is list:
                    handler, items = entry
                    made.append((handler, "".join(self._lines(handler, items))))
                else:
                    made.append(entry)
            plain_write(self, made)

        writer_cls.flush = flush_records
        writer_cls._write = write_records
    else:
        raise ValueError(f"unknown access-log ablation {variant!r}: {VARIANTS}")


def sitecustomize(into: Path, variant: str) -> Path:
    """A folder for ``PYTHONPATH`` whose ``sitecustomize.py`` applies ``variant`` in every
    Python process started with it (the daemon, and a worker it would start)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown access-log ablation {variant!r}: {VARIANTS}")
    into.mkdir(parents=True, exist_ok=True)
    (into / "sitecustomize.py").write_text(
        "from skymesh_lab.bench.access_log_ablate import apply\n"
        f"apply({variant!r})\n")
    return into


if __name__ == "__main__":  # python -m ...access_log_ablate VARIANT: check it applies
    apply(sys.argv[1])
