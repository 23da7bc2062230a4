"""`skymesh forecast eval` as a real process: contract JSON on real data, exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from skymesh.util.procs import executable
from skymesh_lab.sim.workloads.data import data_file


def _eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*executable("skymesh"), "forecast", "eval", "--no-progress", *args],
                          capture_output=True, text=True, timeout=240)


def test_writes_the_contract_json_on_real_hourly_counts(tmp_path: Path) -> None:
    series = data_file("aggregated_hourly_diegohommer", "azure2024_conv_hourly.csv")
    # The last three days (72 hours), with a small mLSTM so the run stays short.
    csv = tmp_path / "slice.csv"
    lines = series.read_text().splitlines()
    csv.write_text("\n".join([lines[0], *lines[-72:]]) + "\n")
    out = tmp_path / "fc.json"
    proc = _eval("--series", str(csv), "--train-frac", "0.67", "--json", str(out),
                 "--param", "mlstm.epochs=15", "--param", "mlstm.hidden=8",
                 "--param", "mlstm.refit_epochs=3", "--param", "arima.harmonics=3")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res["forecasters"]) == {"seasonal-naive", "ets", "arima", "mlstm"}
    for name, s in res["forecasters"].items():
        assert isinstance(s["mean_ape"], float) and isinstance(s["max_ape"], float), name
        assert 0.0 < s["mean_ape"] <= s["max_ape"], name
        assert s["n_scored"] == res["n_test"] == 24
    # Hourly Azure chat counts are smooth: one hour ahead, the fitted models are within
    # tens of percent, not off by the daily swing.
    assert res["forecasters"]["arima"]["mean_ape"] < 0.3
    assert (res["column"], res["window"], res["n_train"], res["horizon"]) == \
        ("conversation", "1h", 48, 1)
    assert "mean APE" in proc.stdout and "arima" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--series", "/nonexistent/series.csv"], "does not exist"),
    (["--column", "nope"], "'nope' is not a column"),
    (["--window", "10x"], "bad window '10x'"),
    (["--forecasters", "arima,prophet"], "unknown prophet"),
    (["--train-frac", "1.5"], "train-frac"),
])
def test_bad_input_exits_2_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    real = str(data_file("aggregated_hourly_diegohommer", "azure2024_conv_hourly.csv"))
    opts = {"--series": real, "--forecasters": "seasonal-naive"}
    opts.update(dict(zip(args[::2], args[1::2], strict=True)))
    out = tmp_path / "x.json"
    proc = _eval(*[x for kv in opts.items() for x in kv], "--json", str(out))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
