"""``skymesh ctl``: a command-line client of the controller's admin API.

    skymesh ctl [--controller URL] [--token-file F] [--json] status
    skymesh ctl regions list | regions add NAME --lat X --lon Y [--cloud-region R]
    skymesh ctl balancers list
    skymesh ctl replicas list | replicas add --url U --model M --region R --gpu G
        [--balancer B] [--kv-events-endpoint tcp://H:P [--kv-events-replay tcp://H:P]]
        | replicas remove|drain|undrain ID
    skymesh ctl policy set BALANCER NAME [--param K=V ...]
    skymesh ctl models list
    skymesh ctl tenants list | tenants set NAME [--key-sha256 H ...] [--requests-per-s X]
        [--tokens-per-min X] [--max-concurrency N] [--tokens-per-day X] [--class C ...]
        [--default-class C] [--weight W] [--scope global|region] | tenants delete NAME

The controller URL comes from ``--controller``, else ``SKYMESH_CONTROLLER_URL``, else
http://127.0.0.1:8080; the token from ``--token-file``, else ``SKYMESH_ADMIN_TOKEN``.
An API error prints ``skymesh ctl: STATUS MESSAGE`` and exits 2, as does an unreachable
controller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
PROG = "skymesh ctl"


class CtlError(Exception):
    """Something the user must fix; printed as ``skymesh ctl: MESSAGE`` with exit 2."""


# -- talking to the controller ----------------------------------------------------------


class Client:
    def __init__(self, base_url: str, token: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise CtlError(f"cannot reach the controller at {self.base_url}: "
                           f"{exc or type(exc).__name__} (set --controller or "
                           "SKYMESH_CONTROLLER_URL)") from None
        if r.status_code >= 400:
            raise CtlError(f"{r.status_code} {_error_message(r)}")
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise CtlError(f"{r.status_code} the controller answered with something other "
                           f"than JSON ({r.headers.get('content-type', 'no content type')})"
                           ) from None


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        # Not our error shape (a proxy in between, say): show what came back, briefly.
        return r.text.strip()[:200] or r.reason_phrase


def _token(args: argparse.Namespace) -> str:
    token = _read_token(args)
    if not (token.isascii() and token.isprintable()):
        # An HTTP header cannot carry it; say so instead of failing deep inside httpx.
        raise CtlError("the token must be printable ASCII")
    return token


def _read_token(args: argparse.Namespace) -> str:
    try:
        return read_admin_token(args.token_file)
    except ValueError as exc:
        raise CtlError(str(exc)) from None


def read_admin_token(token_file: str | None) -> str:
    """The admin token from ``token_file``, else ``$SKYMESH_ADMIN_TOKEN`` (shared by the
    admin-API commands); ValueError with a message naming what to fix."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"--token-file {token_file} is empty")
        return token
    token = os.environ.get("SKYMESH_ADMIN_TOKEN", "").strip()
    if not token:
        raise ValueError("no admin token: set SKYMESH_ADMIN_TOKEN or give --token-file FILE")
    return token


# -- output -----------------------------------------------------------------------------


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list | tuple):
        return ",".join(_cell(x) for x in v) or "-"
    if isinstance(v, dict):
        return ",".join(f"{k}={_cell(x)}" for k, x in v.items()) or "-"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned so digits line up."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [bool(rows) and all(isinstance(row[i], int | float) and not isinstance(row[i], bool)
                                  for row in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w)
                 for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(c) for c in cells)])


def _emit(args: argparse.Namespace, data: Any, render: Callable[[Any], str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(render(data))


# -- subcommands ------------------------------------------------------------------------


def _status(data: dict[str, Any]) -> str:
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(d.items())) or "none"

    head = [f"revision {data['revision']}, up {data['uptime_s']:.0f} s",
            f"regions: {data['regions']}",
            f"balancers: {counts(data['balancers'])}",
            f"replicas: {counts(data['replicas'])}"]
    control = data.get("control")
    if control:
        head.append(_control(control))
    if data.get("moved_replicas"):
        head.append(f"served away from home: {', '.join(data['moved_replicas'])}")
    if data.get("unassigned_replicas"):
        head.append(f"unassigned: {', '.join(data['unassigned_replicas'])}")
    rows = [[name, _cell(r["balancers"]), f"{r['replicas_healthy']}/{r['replicas']}",
             round(r["requests_per_s"], 2), r["queue_length"], r["in_flight"]]
            for name, r in data["per_region"].items()]
    per_region = table(["region", "balancers", "healthy", "req/s", "queue", "in flight"], rows)
    return "\n".join(head) + "\n\n" + per_region


def _control(c: dict[str, Any]) -> str:
    """Who leads the control plane (docs/operations-control-ha.md)."""
    if not c.get("leader"):
        return f"control: no leader (the lease is free); this one ({c.get('id')}) {c.get('role')}"
    age = c.get("lease_age_s")
    held = "" if age is None else f", for {age:.0f} s"
    return (f"control: leader {c['leader']} (epoch {c.get('epoch')}{held}); "
            f"this one ({c.get('id')}) {c.get('role')}")


def _regions(data: list[dict[str, Any]]) -> str:
    return table(["name", "latitude", "longitude", "cloud region"],
                 [[r["name"], r["latitude"], r["longitude"], r.get("cloud_region")]
                  for r in data])


def _balancers(data: list[dict[str, Any]]) -> str:
    return table(["id", "region", "state", "policy", "url"],
                 [[b["id"], b["region"], b.get("state", "unknown"), b.get("policy"), b["url"]]
                  for b in data])


def _replicas(data: list[dict[str, Any]]) -> str:
    return table(["id", "model", "region", "gpu", "state", "home", "assigned", "url"],
                 [[r["id"], r["model"], r["region"], r["gpu"], r.get("state", "unknown"),
                   r.get("balancer"), r.get("assigned"), r["url"]] for r in data])


def _models(data: list[dict[str, Any]]) -> str:
    return table(["name", "replicas", "serving", "regions", "min", "max", "ttft slo s"],
                 [[m["name"], m["replicas"], m["serving"], m["regions"], m["min_replicas"],
                   m.get("max_replicas"), m.get("ttft_slo_s")] for m in data])


def _tenants(data: list[dict[str, Any]]) -> str:
    return table(["name", "scope", "req/s", "tokens/min", "concurrency", "tokens/day",
                  "classes", "keys"],
                 [[t["name"], t.get("scope", "global"), t.get("requests_per_s"),
                   t.get("tokens_per_min"), t.get("max_concurrency"), t.get("tokens_per_day"),
                   t.get("classes") or "all", len(t.get("keys_sha256", []))] for t in data])


# `tenants set` flags -> the tenant's fields (a flag left out leaves the field unset).
TENANT_FIELDS = ("requests_per_s", "tokens_per_min", "max_concurrency", "tokens_per_day",
                 "default_class", "weight", "scope")


def _tenant_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {k: v for k in TENANT_FIELDS
                            if (v := getattr(args, k, None)) is not None}
    body["keys_sha256"] = list(args.key_sha256 or [])
    if args.classes:
        body["classes"] = list(args.classes)
    return body


def _replica_line(verb: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: (f"replica {r['id']} {verb}: state {r.get('state', 'unknown')}, home "
                      f"{_cell(r.get('balancer'))}, assigned {_cell(r.get('assigned'))}")


def run(args: argparse.Namespace, c: Client) -> None:
    what = (args.ctl_cmd, getattr(args, "ctl_action", None))
    if what == ("status", None):
        _emit(args, c.call("GET", "/v1/status"), _status)
    elif what == ("regions", "list"):
        _emit(args, c.call("GET", "/v1/regions"), _regions)
    elif what == ("regions", "add"):
        body = {"name": args.name, "latitude": args.lat, "longitude": args.lon}
        if args.cloud_region:
            body["cloud_region"] = args.cloud_region
        _emit(args, c.call("POST", "/v1/regions", body), lambda r: f"region {r['name']} saved")
    elif what in (("regions", "remove"), ("balancers", "remove"), ("models", "remove")):
        kind = args.ctl_cmd
        c.call("DELETE", f"/v1/{kind}/{_seg(args.id)}")
        _emit(args, {"id": args.id, "removed": True},
              lambda r: f"{kind[:-1]} {r['id']} removed")
    elif what == ("balancers", "list"):
        _emit(args, c.call("GET", "/v1/balancers"), _balancers)
    elif what == ("replicas", "list"):
        _emit(args, c.call("GET", "/v1/replicas"), _replicas)
    elif what == ("replicas", "add"):
        body = {"url": args.url, "model": args.model, "region": args.region, "gpu": args.gpu}
        if args.balancer:
            body["balancer"] = args.balancer
        if args.kv_events_endpoint:
            body["kv_events"] = {"endpoint": args.kv_events_endpoint,
                                 "replay_endpoint": args.kv_events_replay}
        elif args.kv_events_replay:
            raise CtlError("--kv-events-replay needs --kv-events-endpoint")
        _emit(args, c.call("POST", "/v1/replicas", body), _replica_line("added"))
    elif what in (("replicas", "update"), ("balancers", "update")):
        # PATCH: only the fields given change (an agent token may update what it owns).
        body = {k: v for k in UPDATABLE[args.ctl_cmd]
                if (v := getattr(args, k, None)) is not None}
        if not body:
            raise CtlError("nothing to update: give at least one --field")
        kind = args.ctl_cmd
        _emit(args, c.call("PATCH", f"/v1/{kind}/{_seg(args.id)}", body),
              lambda r: f"{kind[:-1]} {r['id']} updated: " + ", ".join(
                  f"{k} {_cell(r.get(k))}" for k in sorted(body)))
    elif what == ("replicas", "remove"):
        c.call("DELETE", f"/v1/replicas/{_seg(args.id)}")
        _emit(args, {"id": args.id, "removed": True}, lambda r: f"replica {r['id']} removed")
    elif what in (("replicas", "drain"), ("replicas", "undrain")):
        verb = "draining" if args.ctl_action == "drain" else "undrained"
        _emit(args, c.call("POST", f"/v1/replicas/{_seg(args.id)}/{args.ctl_action}"),
              _replica_line(verb))
    elif what == ("policy", "set"):
        body = {"policy": args.policy, "params": dict(args.param or [])}
        _emit(args, c.call("PUT", f"/v1/balancers/{_seg(args.balancer)}/policy", body),
              lambda b: f"balancer {b['id']}: policy {b['policy']} {_cell(b['policy_params'])}")
    elif what == ("models", "list"):
        _emit(args, c.call("GET", "/v1/models"), _models)
    elif what == ("models", "add"):
        body = {"name": args.name, "min_replicas": args.min}
        if args.max is not None:
            body["max_replicas"] = args.max
        if args.ttft_slo is not None:
            body["ttft_slo_s"] = args.ttft_slo
        _emit(args, c.call("POST", "/v1/models", body),
              lambda m: f"model {m['name']} saved (replicas {m['min_replicas']}.."
                        f"{_cell(m['max_replicas'])}, TTFT SLO {_cell(m['ttft_slo_s'])})")
    elif what == ("tenants", "list"):
        _emit(args, c.call("GET", "/v1/tenants"), _tenants)
    elif what == ("tenants", "set"):
        _emit(args, c.call("PUT", f"/v1/tenants/{_seg(args.name)}", _tenant_body(args)),
              lambda t: f"tenant {t['name']} saved")
    elif what == ("tenants", "delete"):
        c.call("DELETE", f"/v1/tenants/{_seg(args.name)}")
        _emit(args, {"name": args.name, "removed": True},
              lambda r: f"tenant {r['name']} removed")
    else:  # argparse requires a subcommand, so only a new one missing here lands here
        raise CtlError(f"unhandled command {what}")


UPDATABLE = {"replicas": ("url", "model", "region", "gpu", "balancer", "owner"),
             "balancers": ("url", "region", "peer_address", "owner")}


def _seg(s: str) -> str:
    """A path segment: an id with '/' or '?' must not address another resource."""
    from urllib.parse import quote

    return quote(s, safe="")


def cmd_ctl(args: argparse.Namespace) -> int:
    url = args.controller or os.environ.get("SKYMESH_CONTROLLER_URL") or DEFAULT_URL
    try:
        client = Client(url, _token(args), args.timeout)
        try:
            run(args, client)
        finally:
            client.close()
    except CtlError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


# -- argument parsing -------------------------------------------------------------------


def _kv(pair: str) -> tuple[str, Any]:
    """``K=V`` with V parsed as JSON when it is JSON (``n=4`` gives 4), else kept a string."""
    key, sep, raw = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {pair!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _common(suppress: bool) -> argparse.ArgumentParser:
    # The same options on `ctl` and on every leaf, so `--json` works before or after the
    # subcommand; on leaves SUPPRESS keeps an absent flag from resetting one given earlier.
    p = argparse.ArgumentParser(add_help=False)
    d: Any = argparse.SUPPRESS if suppress else None
    p.add_argument("--controller", metavar="URL", default=d,
                   help=f"controller URL (default: $SKYMESH_CONTROLLER_URL, else {DEFAULT_URL})")
    p.add_argument("--token-file", metavar="FILE", default=d,
                   help="file holding the bearer token (default: $SKYMESH_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS if suppress else False,
                   help="print the API's JSON instead of a table")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   default=d if suppress else 10.0, help="per-request timeout (default 10)")
    return p


def register(subparsers: Any) -> None:
    leaf = [_common(suppress=True)]
    ctl = subparsers.add_parser("ctl", help="manage the mesh through the controller's API",
                                description=__doc__, parents=[_common(suppress=False)],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ctl.set_defaults(fn=cmd_ctl)
    sub = ctl.add_subparsers(dest="ctl_cmd", required=True)

    sub.add_parser("status", parents=leaf, help="mesh summary and per-region load")

    def group(name: str, help: str) -> Any:
        return sub.add_parser(name, help=help).add_subparsers(dest="ctl_action", required=True)

    regions = group("regions", "list, add or remove regions")
    regions.add_parser("list", parents=leaf)
    ra = regions.add_parser("add", parents=leaf, help="add or update a region")
    ra.add_argument("name")
    ra.add_argument("--lat", type=float, required=True, help="latitude, degrees")
    ra.add_argument("--lon", type=float, required=True, help="longitude, degrees")
    ra.add_argument("--cloud-region", help="e.g. us-east-1 (for DNS latency records)")
    regions.add_parser("remove", parents=leaf, help="delete an unused region").add_argument(
        "id", metavar="NAME")

    balancers = group("balancers", "list or remove balancers")
    balancers.add_parser("list", parents=leaf)
    balancers.add_parser("remove", parents=leaf,
                         help="forget a balancer that is home to no replica").add_argument("id")
    bu = balancers.add_parser("update", parents=leaf, help="change fields of a balancer")
    bu.add_argument("id")
    for name in UPDATABLE["balancers"]:
        bu.add_argument(f"--{name.replace('_', '-')}", dest=name)

    replicas = group("replicas", "list, add, remove, drain or undrain replicas")
    replicas.add_parser("list", parents=leaf)
    rp = replicas.add_parser("add", parents=leaf, help="register a replica")
    rp.add_argument("--url", required=True)
    rp.add_argument("--model", required=True)
    rp.add_argument("--region", required=True)
    rp.add_argument("--gpu", required=True, help="e.g. L4, A100, H100")
    rp.add_argument("--balancer", help="home balancer (default: one in the region)")
    rp.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                    help="its engine's KV-cache event publisher (docs/kv-events.md)")
    rp.add_argument("--kv-events-replay", metavar="tcp://HOST:PORT",
                    help="the publisher's replay endpoint")
    ru = replicas.add_parser("update", parents=leaf, help="change fields of a replica")
    ru.add_argument("id")
    for name in UPDATABLE["replicas"]:
        ru.add_argument(f"--{name}", dest=name)
    for action, help in (("remove", "unregister"), ("drain", "take out of service"),
                         ("undrain", "put back in service")):
        replicas.add_parser(action, parents=leaf, help=help).add_argument("id")

    pp = group("policy", "set a balancer's routing policy").add_parser("set", parents=leaf)
    pp.add_argument("balancer")
    pp.add_argument("policy", metavar="NAME")
    pp.add_argument("--param", type=_kv, action="append", metavar="K=V",
                    help="policy parameter (repeatable); values are JSON when they parse")

    models = group("models", "list, declare or remove models")
    models.add_parser("list", parents=leaf)
    ma = models.add_parser("add", parents=leaf, help="declare a model and its limits")
    ma.add_argument("name")
    ma.add_argument("--min", type=int, default=0, help="minimum replicas")
    ma.add_argument("--max", type=int, default=None, help="maximum replicas")
    ma.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS")
    models.add_parser("remove", parents=leaf, help="forget a declared model").add_argument(
        "id", metavar="NAME")

    tenants = group("tenants", "list, set or delete tenants and their limits")
    tenants.add_parser("list", parents=leaf)
    ts = tenants.add_parser("set", parents=leaf, help="create or replace a tenant (fields "
                            "not given are unset: no limit)")
    ts.add_argument("name")
    ts.add_argument("--key-sha256", action="append", metavar="HEX",
                    help="sha256 of a client key (printf %%s KEY | sha256sum); repeatable")
    ts.add_argument("--requests-per-s", type=float)
    ts.add_argument("--tokens-per-min", type=float)
    ts.add_argument("--max-concurrency", type=int)
    ts.add_argument("--tokens-per-day", type=float)
    ts.add_argument("--class", dest="classes", action="append", metavar="CLASS",
                    help="a class it may use (repeatable; default: all)")
    ts.add_argument("--default-class")
    ts.add_argument("--weight", type=float)
    ts.add_argument("--scope", choices=["global", "region"],
                    help="limits for the whole mesh (default) or for each region")
    tenants.add_parser("delete", parents=leaf, help="delete a tenant").add_argument("name")
