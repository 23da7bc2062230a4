"""The in-process bench of the serving wiring (request_path_cost_loop) runs the request
handler start_app wires, and its requests reach the route and the access log."""

from __future__ import annotations

import pytest

from skymesh_lab.bench import request_path_cost_loop as bench


def test_one_build_measures_the_wired_handler_with_the_log_on_and_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.obs import access

    finished: list[int] = []
    real = access._Access.finish

    def counted(self: access._Access, request: object, rec: access.AccessRecord,
                resp: object, status: int | None) -> None:
        finished.append(status or 0)
        real(self, request, rec, resp, status)  # type: ignore[arg-type]

    monkeypatch.setattr(access._Access, "finish", counted)
    got = bench.one(50, 2)
    assert got["on"] > 0 and got["off"] > 0
    assert finished == [200] * 100  # the log's run: every request answered and logged

