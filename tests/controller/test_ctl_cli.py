"""``skymesh ctl`` as a user runs it: a real controller process, the CLI as a subprocess.

Every subcommand is driven through ``.venv/bin/skymesh ctl``; tables are checked row by row
and each change is confirmed through the API itself, not through the CLI's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from controller_support import ADMIN, auth, free_port

from skymesh.util.procs import Daemon, executable, start_daemon


@pytest.fixture(scope="module")
def controller() -> Iterator[Daemon]:
    # A long probe interval: replicas stay in the state the CLI put them in while we look.
    d = start_daemon("skymesh-controller", ["--port", "0", "--probe-interval", "30"],
                     env={**os.environ, "SKYMESH_ADMIN_TOKEN": ADMIN})
    with httpx.Client(base_url=d.url, headers=auth()) as api:
        # Balancers register themselves (agent role); ctl only lists them.
        for region, lat, lon in (("us-east", 38.9, -77.0), ("eu-west", 53.3, -6.2)):
            api.post("/v1/regions", json={"name": region, "latitude": lat, "longitude": lon}
                     ).raise_for_status()
            api.post("/v1/balancers", json={"id": f"lb-{region}", "region": region,
                                            "url": f"http://127.0.0.1:{free_port()}"}
                     ).raise_for_status()
    yield d
    d.stop()


def ctl(url: str, *args: str, token: str = ADMIN, extra_env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SKYMESH_ADMIN_TOKEN", "SKYMESH_CONTROLLER_URL")}
    env.update(SKYMESH_CONTROLLER_URL=url, SKYMESH_ADMIN_TOKEN=token, **(extra_env or {}))
    return subprocess.run([*executable("skymesh"), "ctl", *args], env=env, text=True,
                          capture_output=True, timeout=60)


def ok(url: str, *args: str, token: str = ADMIN) -> str:
    p = ctl(url, *args, token=token)
    assert p.returncode == 0, f"skymesh ctl {' '.join(args)}: {p.returncode}\n{p.stderr}"
    return p.stdout


def rows(table: str) -> dict[str, list[str]]:
    """A printed table keyed by its first column (header row included, under its name)."""
    return {cells[0]: cells for cells in (line.split() for line in table.splitlines())
            if cells}


def get(url: str, path: str) -> Any:
    r = httpx.get(url + path, headers=auth())
    r.raise_for_status()
    return r.json()


def test_ctl_regions_add_and_list(controller: Daemon) -> None:
    url = controller.url
    out = ok(url, "regions", "add", "ap-northeast", "--lat", "35.7", "--lon", "139.7",
             "--cloud-region", "ap-northeast-1")
    assert "ap-northeast" in out
    stored = {r["name"]: r for r in get(url, "/v1/regions")}
    assert stored["ap-northeast"] == {"name": "ap-northeast", "latitude": 35.7,
                                      "longitude": 139.7, "cloud_region": "ap-northeast-1"}

    listing = ok(url, "regions", "list")
    table = rows(listing)
    assert table["NAME"] == ["NAME", "LATITUDE", "LONGITUDE", "CLOUD", "REGION"]
    assert table["ap-northeast"] == ["ap-northeast", "35.7", "139.7", "ap-northeast-1"]
    assert table["eu-west"] == ["eu-west", "53.3", "-6.2", "-"]

    # Aligned: text columns start under their header, numbers end under theirs.
    lines = listing.splitlines()
    cloud, lon_end = lines[0].index("CLOUD REGION"), lines[0].index("LONGITUDE") + 9
    for line in lines[1:]:
        _name, _lat, lon, region = line.split()
        assert line[cloud:].startswith(region) and line[:lon_end].endswith(" " + lon), lines


def test_ctl_region_invalid_latitude_is_an_api_error(controller: Daemon) -> None:
    p = ctl(controller.url, "regions", "add", "nowhere", "--lat", "123", "--lon", "0")
    assert p.returncode == 2
    assert p.stderr.startswith("skymesh ctl: 422 latitude:"), p.stderr
    assert "nowhere" not in json.dumps(get(controller.url, "/v1/regions"))


def test_ctl_balancers_list(controller: Daemon) -> None:
    table = rows(ok(controller.url, "balancers", "list"))
    assert table["ID"] == ["ID", "REGION", "STATE", "POLICY", "URL"]
    assert table["lb-us-east"][1] == "us-east"
    assert table["lb-eu-west"][1] == "eu-west"
    assert table["lb-us-east"][2] in ("unknown", "down")


def test_ctl_replica_lifecycle(controller: Daemon) -> None:
    url = controller.url
    rep_url = f"http://127.0.0.1:{free_port()}"
    out = ok(url, "replicas", "add", "--url", rep_url, "--model", "llama-3-8b",
             "--region", "eu-west", "--gpu", "L4", "--balancer", "lb-eu-west")
    added = [r for r in get(url, "/v1/replicas") if r["url"] == rep_url]
    assert len(added) == 1
    rid = added[0]["id"]
    assert added[0]["balancer"] == "lb-eu-west" and added[0]["gpu"] == "L4"
    assert rid in out

    row = rows(ok(url, "replicas", "list"))[rid]
    assert row[:4] == [rid, "llama-3-8b", "eu-west", "L4"]
    assert row[5] == "lb-eu-west" and row[-1] == rep_url

    out = ok(url, "replicas", "update", rid, "--gpu", "H100")  # PATCH: the rest stays
    assert "gpu H100" in out and get(url, f"/v1/replicas/{rid}")["gpu"] == "H100"
    assert get(url, f"/v1/replicas/{rid}")["url"] == rep_url
    p = ctl(url, "replicas", "update", rid, "--url", "http://169.254.169.254")
    assert p.returncode == 2 and "metadata" in p.stderr
    assert ctl(url, "replicas", "update", rid).returncode == 2  # nothing to update

    ok(url, "replicas", "drain", rid)
    assert get(url, f"/v1/replicas/{rid}")["state"] == "draining"
    assert rows(ok(url, "replicas", "list"))[rid][4] == "draining"
    ok(url, "replicas", "undrain", rid)
    assert get(url, f"/v1/replicas/{rid}")["state"] != "draining"

    models = rows(ok(url, "models", "list"))
    assert models["llama-3-8b"][:2] == ["llama-3-8b", "1"]
    assert "eu-west" in models["llama-3-8b"]

    ok(url, "replicas", "remove", rid)
    assert httpx.get(f"{url}/v1/replicas/{rid}", headers=auth()).status_code == 404
    p = ctl(url, "replicas", "remove", rid)
    assert (p.returncode, p.stderr.strip()) == (2, f"skymesh ctl: 404 no replica named {rid!r}")


def test_ctl_replica_default_home_is_in_its_region(controller: Daemon) -> None:
    rep_url = f"http://127.0.0.1:{free_port()}"
    data = json.loads(ok(controller.url, "--json", "replicas", "add", "--url", rep_url,
                         "--model", "m", "--region", "us-east", "--gpu", "A100"))
    assert data["balancer"] == "lb-us-east"
    ok(controller.url, "replicas", "remove", data["id"])


def test_ctl_replica_add_with_its_kv_events_endpoint(controller: Daemon) -> None:
    rep_url = f"http://127.0.0.1:{free_port()}"
    data = json.loads(ok(controller.url, "--json", "replicas", "add", "--url", rep_url,
                         "--model", "m", "--region", "us-east", "--gpu", "L4",
                         "--kv-events-endpoint", "tcp://10.0.0.5:5557",
                         "--kv-events-replay", "tcp://10.0.0.5:5558"))
    assert data["kv_events"] == {"endpoint": "tcp://10.0.0.5:5557",
                                 "replay_endpoint": "tcp://10.0.0.5:5558"}
    ok(controller.url, "replicas", "remove", data["id"])
    bad = ctl(controller.url, "replicas", "add", "--url", rep_url, "--model", "m",
              "--region", "us-east", "--gpu", "L4", "--kv-events-endpoint", "http://x:1")
    assert bad.returncode == 2 and "kv_events" in bad.stderr  # the API's 422, named


def test_ctl_policy_set(controller: Daemon) -> None:
    url = controller.url
    ok(url, "policy", "set", "lb-eu-west", "consistent-hash", "--param", "virtual_nodes=40")
    lb = get(url, "/v1/balancers/lb-eu-west")
    assert (lb["policy"], lb["policy_params"]) == (
        "consistent-hash", {"virtual_nodes": 40})  # a number, not the string "40"

    ok(url, "policy", "set", "lb-us-east", "round-robin")
    assert get(url, "/v1/balancers/lb-us-east")["policy"] == "round-robin"
    assert rows(ok(url, "balancers", "list"))["lb-us-east"][3] == "round-robin"

    p = ctl(url, "policy", "set", "lb-us-east", "no-such-policy")
    assert p.returncode == 2 and p.stderr.startswith("skymesh ctl: 422 policy:"), p.stderr
    p = ctl(url, "policy", "set", "lb-us-east", "round-robin", "--param", "bogus=1")
    assert p.returncode == 2 and "bogus" in p.stderr, p.stderr
    assert get(url, "/v1/balancers/lb-us-east")["policy"] == "round-robin"


def test_ctl_status_table_and_json(controller: Daemon) -> None:
    out = ok(controller.url, "status")
    assert "regions: " in out
    table = rows(out.split("\n\n", 1)[1])
    assert table["REGION"][:3] == ["REGION", "BALANCERS", "HEALTHY"]
    assert table["us-east"][1].startswith("lb-us-east=")

    raw = json.loads(ok(controller.url, "status", "--json"))  # --json after the subcommand
    assert set(raw["per_region"]) >= {"us-east", "eu-west"}
    assert raw["regions"] == len(get(controller.url, "/v1/regions"))


def test_ctl_json_lists_are_the_api_objects(controller: Daemon) -> None:
    assert json.loads(ok(controller.url, "--json", "balancers", "list")) == get(
        controller.url, "/v1/balancers")


def test_ctl_bad_token_is_rejected(controller: Daemon) -> None:
    p = ctl(controller.url, "regions", "list", token="not-the-token")
    assert p.returncode == 2
    assert p.stderr.strip() == "skymesh ctl: 401 a valid bearer token is required"
    assert p.stdout == ""


def test_ctl_token_file_wins_over_env(controller: Daemon, tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(ADMIN + "\n")
    assert "us-east" in ok(controller.url, "--token-file", str(f), "regions", "list",
                           token="wrong-env-token")
    p = ctl(controller.url, "--token-file", str(tmp_path / "missing"), "status")
    assert p.returncode == 2 and "--token-file" in p.stderr


def test_ctl_unreachable_controller() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p = ctl(dead, "status")
    assert p.returncode == 2
    assert p.stderr.startswith(f"skymesh ctl: cannot reach the controller at {dead}"), p.stderr
    assert "Traceback" not in p.stderr
    # --controller overrides the environment.
    p = ctl("http://127.0.0.1:9", "--controller", dead, "status")
    assert dead in p.stderr and p.returncode == 2


def test_ctl_models_add_and_removals(controller: Daemon) -> None:
    out = ok(controller.url, "models", "add", "qwen", "--min", "1", "--max", "4",
             "--ttft-slo", "2.5")
    assert "model qwen saved" in out
    declared = {m["name"]: m for m in get(controller.url, "/v1/models")}
    assert (declared["qwen"]["min_replicas"], declared["qwen"]["max_replicas"],
            declared["qwen"]["ttft_slo_s"]) == (1, 4, 2.5)
    assert "model qwen removed" in ok(controller.url, "models", "remove", "qwen")
    assert "qwen" not in {m["name"] for m in get(controller.url, "/v1/models")}
    bad = ctl(controller.url, "models", "add", "x", "--min", "3", "--max", "1")
    assert bad.returncode == 2 and "max_replicas" in bad.stderr

    ok(controller.url, "regions", "add", "tmp-region", "--lat", "1", "--lon", "2")
    api = httpx.Client(base_url=controller.url, headers=auth())
    api.post("/v1/balancers", json={"id": "lb-tmp", "region": "tmp-region",
                                    "url": f"http://127.0.0.1:{free_port()}"}
             ).raise_for_status()
    busy = ctl(controller.url, "regions", "remove", "tmp-region")
    assert busy.returncode == 2 and "409" in busy.stderr and "lb-tmp" in busy.stderr
    assert "balancer lb-tmp removed" in ok(controller.url, "balancers", "remove", "lb-tmp")
    assert "region tmp-region removed" in ok(controller.url, "regions", "remove", "tmp-region")
    assert "tmp-region" not in {r["name"] for r in get(controller.url, "/v1/regions")}
    api.close()


def test_ctl_tenants_set_list_delete(controller: Daemon) -> None:
    url = controller.url
    digest = "ab" * 32
    out = ok(url, "tenants", "set", "acme", "--key-sha256", digest, "--requests-per-s", "5",
             "--class", "interactive", "--class", "standard", "--scope", "region")
    assert "tenant acme saved" in out
    stored = get(url, "/v1/tenants/acme")
    assert stored["keys_sha256"] == [digest] and stored["requests_per_s"] == 5.0
    assert stored["classes"] == ["interactive", "standard"] and stored["scope"] == "region"
    assert stored["tokens_per_min"] is None

    table = rows(ok(url, "tenants", "list"))
    assert table["acme"] == ["acme", "region", "5", "-", "-", "-", "interactive,standard", "1"]

    bad = ctl(url, "tenants", "set", "acme", "--key-sha256", "sk-a-plaintext-key")
    assert bad.returncode == 2 and "422" in bad.stderr and "plaintext" not in bad.stderr
    assert "tenant acme removed" in ok(url, "tenants", "delete", "acme")
    assert get(url, "/v1/tenants") == []
