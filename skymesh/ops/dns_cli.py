"""``skymesh dns sync``: ask the controller to reconcile Route53 with its state.

    skymesh dns sync [--dry-run] [--controller URL] [--token-file FILE] [--json PATH]

The controller does the work (it holds the balancers' states and the AWS settings); this
command calls ``POST /v1/dns/sync`` with the admin token from ``SKYMESH_ADMIN_TOKEN`` or
``--token-file`` and prints the report as a table. Exit 0 when the controller answered
with a report, 2 when it could not be asked (no token, unreachable, a non-2xx answer).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from skymesh.util.jsonio import write_json

DEFAULT_CONTROLLER = "http://127.0.0.1:8080"
# Report keys in the order the table shows them, with their labels.
SECTIONS = (
    ("created", "record created"),
    ("updated", "record updated"),
    ("deleted", "record withdrawn"),
    ("unchanged", "record unchanged"),
    ("health_checks_created", "health check created"),
    ("health_checks_deleted", "health check deleted"),
)


class CliError(Exception):
    """A failure to report in one line, with exit code 2."""


def register(subparsers: Any) -> None:
    dp = subparsers.add_parser("dns", help="Route53 records of the balancers")
    dsub = dp.add_subparsers(dest="dns_cmd", required=True)
    sp = dsub.add_parser("sync", help="reconcile Route53 with the controller's state",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--dry-run", action="store_true",
                    help="report what would change without changing it")
    sp.add_argument("--controller", default=None, metavar="URL",
                    help="controller base URL (default: $SKYMESH_CONTROLLER_URL, else "
                         f"{DEFAULT_CONTROLLER})")
    sp.add_argument("--token-file", default=None, metavar="FILE",
                    help="file holding the admin token (default: $SKYMESH_ADMIN_TOKEN)")
    sp.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long to wait for the controller (default: %(default)s)")
    sp.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    sp.set_defaults(fn=cmd_dns_sync)


def _token(token_file: str | None) -> str:
    from skymesh.ops.ctl import read_admin_token

    try:
        return read_admin_token(token_file)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _error_detail(resp: Any) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


def request_sync(base: str, token: str, dry_run: bool, timeout: float) -> dict[str, Any]:
    import httpx

    url = base.rstrip("/") + "/v1/dns/sync"
    try:
        resp = httpx.post(url, json={"dry_run": dry_run}, timeout=timeout,
                          headers={"Authorization": f"Bearer {token}"})
    except httpx.InvalidURL as exc:
        raise CliError(f"--controller {base!r} is not a usable URL: {exc}") from None
    except httpx.UnsupportedProtocol:
        raise CliError(f"--controller {base!r} must start with http:// or https://") from None
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the controller at {base}: {exc}") from None
    if not resp.is_success:
        raise CliError(f"the controller answered {resp.status_code}: {_error_detail(resp)}")
    try:
        report = resp.json()
    except ValueError:
        raise CliError("the controller's answer is not JSON") from None
    if not isinstance(report, dict):
        raise CliError("the controller's answer is not a sync report")
    return report


def format_report(report: dict[str, Any]) -> str:
    rows = [(label, str(item)) for key, label in SECTIONS for item in report.get(key) or []]
    head = "dry run: nothing was changed" if report.get("dry_run") else "Route53 synced"
    lines = [head]
    if rows:
        width = max(len("change"), *(len(label) for label, _ in rows))
        lines.append(f"  {'change':<{width}}  balancer")
        lines.append(f"  {'-' * width}  {'-' * 8}")
        lines += [f"  {label:<{width}}  {item}" for label, item in rows]
    else:
        lines.append("  no SkyMesh records or health checks")
    errors = report.get("errors") or []
    if errors:
        lines.append(f"errors ({len(errors)}):")
        lines += [f"  - {e}" for e in errors]
    return "\n".join(lines)


def cmd_dns_sync(args: argparse.Namespace) -> int:
    base = args.controller or os.environ.get("SKYMESH_CONTROLLER_URL") or DEFAULT_CONTROLLER
    try:
        if not args.timeout > 0:
            raise CliError("--timeout must be positive")
        report = request_sync(base, _token(args.token_file), args.dry_run, args.timeout)
    except CliError as exc:
        print(f"skymesh dns sync: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    write_json(args.json, report)
    return 0
