"""Where the workloads' data comes from: the variable, a checkout's default, or an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from skymesh_lab.sim.workloads.data import DATA_DIR_ENV, data_dir, is_checkout


def make_checkout(tmp_path: Path, name: str = "skymesh") -> Path:
    root = tmp_path / "main"
    (root / "skymesh").mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.1.0"\n')
    return root


def test_the_variable_wins_everywhere(tmp_path: Path) -> None:
    data = tmp_path / "traces"
    data.mkdir()
    root = make_checkout(tmp_path)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert data_dir({DATA_DIR_ENV: str(data)}, root) == data
    assert data_dir({DATA_DIR_ENV: str(data)}, tmp_path / "site-packages") == data
    with pytest.raises(FileNotFoundError, match=f"from \\${DATA_DIR_ENV}"):
        data_dir({DATA_DIR_ENV: str(tmp_path / "missing")}, root)


def test_a_checkout_defaults_to_the_shared_folder_beside_it(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    assert is_checkout(root)
    with pytest.raises(FileNotFoundError, match=f"{DATA_DIR_ENV} is not set") as err:
        data_dir({}, root)
    assert str(tmp_path / "shared" / "data") in str(err.value)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert data_dir({}, root) == tmp_path / "shared" / "data"
    assert data_dir({DATA_DIR_ENV: ""}, root) == tmp_path / "shared" / "data"


def test_outside_a_checkout_there_is_no_default_and_the_error_names_the_variable(
        tmp_path: Path) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    # Even with a shared/data folder where the checkout's default would look.
    (site.parent / "shared" / "data").mkdir(parents=True)
    other = make_checkout(tmp_path / "elsewhere", name="not-skymesh")
    for root in (site, other):
        assert not is_checkout(root)
        with pytest.raises(FileNotFoundError, match=f"set {DATA_DIR_ENV} to") as err:
            data_dir({}, root)
        assert "outside a source checkout" in str(err.value)


def test_this_checkout_is_recognised() -> None:
    here = Path(__file__).resolve().parents[2]
    assert is_checkout(here)
