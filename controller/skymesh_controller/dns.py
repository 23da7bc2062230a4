"""Route53 latency records for the regional balancers (SkyLB section 4.1).

Every balancer that is up gets one latency-based record under the service name (``Name``
= the configured record, ``SetIdentifier`` = the balancer id, ``Region`` = its region's
cloud region) guarded by a Route53 health check on its ``/health``. Route53 then answers
each client with the nearest balancer whose check passes.

Two halves:

- :func:`desired_state` is pure: the controller's balancers and regions (plain dicts as
  the REST API lists them, or any objects with those attributes) in, the records and
  health checks that should exist out, plus an error for every balancer that cannot have
  a record (no cloud region, bad URL).
- :class:`Route53Manager` does the I/O: it lists what SkyMesh owns in the zone, then
  creates, updates and deletes so that the zone matches, and reports what it did.

What a balancer's state does to its record:

- ``up``: published.
- ``down``: the record is withdrawn, the health check is *kept*. The controller's verdict
  is what withdraws it (its probes can see a sick balancer that still answers Route53's
  checkers, e.g. one with no healthy replica). Keeping the check means a balancer that
  comes back is restored with a single record change, under a check that already has a
  history, and a flapping balancer does not churn health checks (each costs a create
  call, a one-use CallerReference and money). A balancer the controller no longer knows
  at all loses both.
- ``unknown`` (not probed yet, e.g. just after a controller restart): left exactly as it
  is. Withdrawing on ignorance would take the whole service out of DNS whenever a
  controller starts; Route53's own check still guards the record meanwhile.

Ownership: a health check is SkyMesh's when its CallerReference starts with ``skymesh-``
and its tags say ``skymesh:record`` = this record name (so two deployments in one account
never touch each other's). A record is SkyMesh's when it sits under this record name, has
a ``SetIdentifier``, and either points at one of our health checks or carries the id of a
balancer the controller knows. Everything else in the zone is never touched.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any, Literal, overload

from botocore.exceptions import BotoCoreError, ClientError

from skymesh.net import urlpolicy

CALLER_PREFIX = "skymesh-"
TAG_MANAGED = "skymesh:managed-by"
TAG_RECORD = "skymesh:record"
TAG_BALANCER = "skymesh:balancer"
# ListTagsForResources accepts at most this many ids per call.
_TAGS_PER_CALL = 10

RecordType = Literal["A", "AAAA", "CNAME"]


class DnsConfigError(ValueError):
    """The dns section of the controller's configuration is unusable."""


def fqdn(name: str) -> str:
    """Route53 spells names absolute and lower case: ``API.example.com`` -> ``api.example.com.``"""
    return name.strip().lower().rstrip(".") + "."


@dataclass(frozen=True)
class DnsSettings:
    """What the manager needs from the controller's ``dns`` section.

    ``health_check_interval_s`` (10 or 30, Route53's two choices) and
    ``failure_threshold`` (1-10) are optional; the rest follows ``skymesh_controller.config``.
    """

    record: str
    zone: str | None = None
    zone_id: str | None = None
    ttl: int = 60
    health_check_path: str = "/health"
    health_check_interval_s: int = 30
    failure_threshold: int = 3
    endpoint_url: str | None = None
    aws_region: str = "us-east-1"

    def __post_init__(self) -> None:
        if not self.record or not self.record.strip(". "):
            raise DnsConfigError("dns.record: give the service name, e.g. api.example.com")
        if not (self.zone or self.zone_id):
            raise DnsConfigError("dns: give zone (the hosted zone's name) or zone_id")
        if self.zone and not fqdn(self.record).endswith("." + fqdn(self.zone)) \
                and fqdn(self.record) != fqdn(self.zone):
            raise DnsConfigError(f"dns.record: {self.record} is not inside zone {self.zone}")
        if self.ttl < 1:
            raise DnsConfigError("dns.ttl: must be at least 1 second")
        if not self.health_check_path.startswith("/"):
            raise DnsConfigError("dns.health_check_path: must start with /")
        if self.health_check_interval_s not in (10, 30):
            raise DnsConfigError("dns.health_check_interval_s: Route53 allows 10 or 30")
        if not 1 <= self.failure_threshold <= 10:
            raise DnsConfigError("dns.failure_threshold: Route53 allows 1 to 10")

    @property
    def name(self) -> str:
        return fqdn(self.record)

    @classmethod
    def of(cls, cfg: Any) -> DnsSettings:
        """From the controller's ``DnsConfig`` (or any object or mapping with its keys)."""
        if isinstance(cfg, DnsSettings):
            return cfg
        values = {k: _get(cfg, k) for k in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in values.items() if v is not None})


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


# -- the pure half ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HealthCheckSpec:
    """A Route53 HTTP(S) health check on one balancer."""

    balancer_id: str
    host: str                # an IP address or a hostname
    port: int
    path: str
    https: bool
    interval_s: int
    failure_threshold: int

    @property
    def is_ip(self) -> bool:
        return _is_ip(self.host)

    def config(self) -> dict[str, Any]:
        """The ``HealthCheckConfig`` to create."""
        cfg: dict[str, Any] = {
            "Type": "HTTPS" if self.https else "HTTP",
            "Port": self.port,
            "ResourcePath": self.path,
            "RequestInterval": self.interval_s,
            "FailureThreshold": self.failure_threshold,
        }
        if self.is_ip:
            cfg["IPAddress"] = self.host
        else:
            cfg["FullyQualifiedDomainName"] = self.host
            if self.https:
                cfg["EnableSNI"] = True
        return cfg

    def matches(self, existing: Mapping[str, Any]) -> bool:
        """Whether an existing check's ``HealthCheckConfig`` probes what this one would."""
        want = self.config()
        return all(_norm(existing.get(k)) == _norm(v) for k, v in want.items())


@dataclass(frozen=True)
class DesiredRecord:
    """One latency record: what Route53 should answer for this balancer."""

    name: str                # absolute, e.g. "api.example.com."
    set_identifier: str      # the balancer id
    type: RecordType
    value: str
    region: str              # the AWS region Route53 measures latency to
    ttl: int
    health_check: HealthCheckSpec


@dataclass(frozen=True)
class DesiredState(Sequence[DesiredRecord]):
    """What the zone should hold, from the controller's view.

    It is a sequence of the records to publish (what :func:`desired_records` promises),
    and carries what a bare list cannot: checks to keep, balancers to leave alone, errors.
    """

    records: tuple[DesiredRecord, ...] = ()
    # Balancers that are down: no record, but their health check stays.
    retained_checks: tuple[HealthCheckSpec, ...] = ()
    # Balancers in state "unknown": their record and check are left as they are.
    held: frozenset[str] = frozenset()
    errors: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> DesiredRecord: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[DesiredRecord]: ...
    def __getitem__(self, i: int | slice) -> DesiredRecord | Sequence[DesiredRecord]:
        return self.records[i]

    @property
    def known(self) -> frozenset[str]:
        return frozenset({r.set_identifier for r in self.records}
                         | {h.balancer_id for h in self.retained_checks} | self.held)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _norm(v: Any) -> Any:
    return v.lower().rstrip(".") if isinstance(v, str) else v


@cache
def route53_regions() -> frozenset[str]:
    """The regions Route53 accepts in a latency record, from botocore's service model."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("route53")
    return frozenset(model.shape_for("ResourceRecordSetRegion").enum)


def _endpoint(url: str) -> tuple[str, int, bool]:
    """(host, port, https) of a balancer URL; the URL syntax rules are urlpolicy's."""
    try:
        t = urlpolicy.parse(url)
    except urlpolicy.UrlRejected as exc:
        raise ValueError(f"url {url!r}: {exc}") from None
    return t.host, t.port, t.scheme == "https"


def desired_state(balancers: Iterable[Any], regions: Iterable[Any], cfg: Any) -> DesiredState:
    """The records and health checks the zone should hold for these balancers."""
    settings = DnsSettings.of(cfg)
    cloud_of = {str(_get(r, "name")): _get(r, "cloud_region") for r in regions}
    records: list[DesiredRecord] = []
    retained: list[HealthCheckSpec] = []
    held: set[str] = set()
    errors: list[str] = []
    for b in sorted(balancers, key=lambda b: str(_get(b, "id"))):
        bid, region, state = str(_get(b, "id")), str(_get(b, "region")), _get(b, "state")
        if state not in ("up", "down"):
            held.add(bid)
            continue
        try:
            host, port, https = _endpoint(str(_get(b, "url")))
        except ValueError as exc:
            errors.append(f"{bid}: {exc}")
            continue
        check = HealthCheckSpec(bid, host, port, settings.health_check_path, https,
                                settings.health_check_interval_s, settings.failure_threshold)
        if state == "down":
            retained.append(check)
            continue
        if region not in cloud_of:
            errors.append(f"{bid}: region {region!r} is not registered with the controller")
            continue
        cloud = cloud_of[region]
        if not cloud:
            errors.append(f"{bid}: region {region!r} has no cloud_region, so Route53 cannot "
                          "route to it by latency (set cloud_region, e.g. us-east-1)")
            continue
        if cloud not in route53_regions():
            errors.append(f"{bid}: region {region!r} has cloud_region {cloud!r}, which "
                          "Route53 does not accept for latency records")
            continue
        kind: RecordType = "CNAME"
        if _is_ip(host):
            kind = "A" if ipaddress.ip_address(host).version == 4 else "AAAA"
        records.append(DesiredRecord(settings.name, bid, kind, host.lower(), cloud,
                                     settings.ttl, check))
    # A CNAME cannot share its name with any other record: hostnames and addresses under
    # one service name would make Route53 refuse the whole change.
    if any(r.type == "CNAME" for r in records) and any(r.type != "CNAME" for r in records):
        for r in records:
            if r.type == "CNAME":
                errors.append(f"{r.set_identifier}: its url names a host ({r.value}) while "
                              "other balancers use IP addresses; a CNAME cannot share "
                              f"{settings.name} with A/AAAA records")
        records = [r for r in records if r.type != "CNAME"]
    return DesiredState(tuple(records), tuple(retained), frozenset(held), tuple(errors))


# The name the controller calls it by: the result reads as the list of records to publish.
desired_records = desired_state


# -- the report --------------------------------------------------------------------------------

@dataclass
class SyncReport:
    """What a sync changed (or, with ``dry_run``, would change), by balancer id."""

    dry_run: bool = False
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    health_checks_created: list[str] = field(default_factory=list)
    health_checks_deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted
                    or self.health_checks_created or self.health_checks_deleted)


# -- the I/O half ------------------------------------------------------------------------------

@dataclass
class _OwnedCheck:
    id: str
    balancer_id: str
    config: dict[str, Any]


def _record_set(d: DesiredRecord, health_check_id: str) -> dict[str, Any]:
    return {
        "Name": d.name,
        "Type": d.type,
        "SetIdentifier": d.set_identifier,
        "Region": d.region,
        "TTL": d.ttl,
        "ResourceRecords": [{"Value": d.value}],
        "HealthCheckId": health_check_id,
    }


def _same_record(existing: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    def values(rrs: Mapping[str, Any]) -> set[str]:
        return {_norm(v["Value"]) for v in rrs.get("ResourceRecords", [])}

    return (existing.get("Type") == want["Type"] and existing.get("Region") == want["Region"]
            and existing.get("TTL") == want["TTL"] and values(existing) == values(want)
            and existing.get("HealthCheckId") == want["HealthCheckId"]
            and "AliasTarget" not in existing)


def _caller_reference(name: str, balancer_id: str) -> str:
    # One-use token (Route53 refuses a CallerReference it has seen, even after deletion);
    # the hash keeps it within 64 characters whatever the ids are.
    digest = hashlib.sha256(f"{name}|{balancer_id}".encode()).hexdigest()[:16]
    return f"{CALLER_PREFIX}{digest}-{uuid.uuid4().hex[:16]}"


def _client_error_text(exc: Exception) -> str:
    resp = getattr(exc, "response", None)
    if isinstance(resp, Mapping):
        err = resp.get("Error", {})
        return f"{err.get('Code', type(exc).__name__)}: {err.get('Message', exc)}"
    return f"{type(exc).__name__}: {exc}"


class Route53Manager:
    """Makes one hosted zone hold :class:`DesiredState`'s records, and nothing else of ours."""

    def __init__(self, client: Any, cfg: Any) -> None:
        self.client = client
        self.settings = DnsSettings.of(cfg)
        self._zone_id: str | None = self.settings.zone_id

    @classmethod
    def from_config(cls, cfg: Any) -> Route53Manager:
        """A manager with its own boto3 client (see :func:`make_client`)."""
        return cls(make_client(cfg), cfg)

    @property
    def cfg(self) -> DnsSettings:
        return self.settings

    def zone_id(self) -> str:
        if self._zone_id is None:
            zone = fqdn(self.settings.zone or "")
            resp = self.client.list_hosted_zones_by_name(DNSName=zone, MaxItems="100")
            found = [z for z in resp.get("HostedZones", []) if fqdn(z["Name"]) == zone]
            public = [z for z in found if not z.get("Config", {}).get("PrivateZone")]
            if not found:
                raise LookupError(f"no hosted zone named {zone}")
            if len(public) > 1 or (not public and len(found) > 1):
                raise LookupError(f"several hosted zones are named {zone}: give dns.zone_id")
            self._zone_id = (public or found)[0]["Id"].rsplit("/", 1)[-1]
        return self._zone_id

    # -- reading -----------------------------------------------------------------------------
    def owned_checks(self) -> list[_OwnedCheck]:
        candidates = []
        for page in self.client.get_paginator("list_health_checks").paginate():
            for hc in page.get("HealthChecks", []):
                if str(hc.get("CallerReference", "")).startswith(CALLER_PREFIX):
                    candidates.append(hc)
        out: list[_OwnedCheck] = []
        for i in range(0, len(candidates), _TAGS_PER_CALL):
            chunk = candidates[i:i + _TAGS_PER_CALL]
            resp = self.client.list_tags_for_resources(
                ResourceType="healthcheck", ResourceIds=[hc["Id"] for hc in chunk])
            tags = {s["ResourceId"]: {t["Key"]: t["Value"] for t in s.get("Tags", [])}
                    for s in resp.get("ResourceTagSets", [])}
            for hc in chunk:
                t = tags.get(hc["Id"], {})
                if t.get(TAG_RECORD) == self.settings.name and TAG_BALANCER in t:
                    out.append(_OwnedCheck(hc["Id"], t[TAG_BALANCER], hc["HealthCheckConfig"]))
        return out

    def records_under_name(self) -> list[dict[str, Any]]:
        name = self.settings.name
        out: list[dict[str, Any]] = []
        paginator = self.client.get_paginator("list_resource_record_sets")
        for page in paginator.paginate(HostedZoneId=self.zone_id(), StartRecordName=name):
            for rrs in page.get("ResourceRecordSets", []):
                if fqdn(rrs["Name"]) != name:
                    # Listing is sorted by name: past ours, nothing more is ours.
                    return out
                out.append(rrs)
        return out

    # -- reconciling -------------------------------------------------------------------------
    def sync(self, desired: DesiredState | Sequence[DesiredRecord],
             dry_run: bool = False) -> SyncReport:
        """Make the zone match ``desired``; a plain list of records (not a
        :class:`DesiredState`) means every other SkyMesh record and check under the name
        goes."""
        if not isinstance(desired, DesiredState):
            desired = DesiredState(records=tuple(desired))
        report = SyncReport(dry_run=dry_run, errors=list(desired.errors))
        try:
            self._sync(desired, report, dry_run)
        except LookupError as exc:
            report.errors.append(str(exc))
        except (ClientError, BotoCoreError) as exc:
            report.errors.append(f"Route53: {_client_error_text(exc)}")
        return report

    def _sync(self, desired: DesiredState, report: SyncReport, dry_run: bool) -> None:
        checks = self.owned_checks()
        check_ids = {c.id for c in checks}
        known = desired.known
        mine = [r for r in self.records_under_name()
                if "SetIdentifier" in r and (r.get("HealthCheckId") in check_ids
                                             or r["SetIdentifier"] in known)]
        existing = {r["SetIdentifier"]: r for r in mine}

        def find_check(spec: HealthCheckSpec, prefer: str | None) -> _OwnedCheck | None:
            fits = [c for c in checks
                    if c.balancer_id == spec.balancer_id and spec.matches(c.config)]
            return next((c for c in fits if c.id == prefer), fits[0] if fits else None)

        # 1. A health check for every record to publish; down balancers keep theirs.
        keep: set[str] = set()
        check_for: dict[str, str] = {}
        for d in desired.records:
            have = existing.get(d.set_identifier)
            found = find_check(d.health_check, have.get("HealthCheckId") if have else None)
            if found is not None:
                check_for[d.set_identifier] = found.id
                keep.add(found.id)
                continue
            if dry_run:
                check_for[d.set_identifier] = f"(new health check for {d.set_identifier})"
            else:
                try:
                    check_for[d.set_identifier] = self._create_check(d.health_check)
                except (ClientError, BotoCoreError) as exc:
                    report.errors.append(f"{d.set_identifier}: creating its health check: "
                                         f"{_client_error_text(exc)}")
                    continue
            report.health_checks_created.append(d.set_identifier)
        for spec in desired.retained_checks:
            found = find_check(spec, None)
            if found is not None:
                keep.add(found.id)
        # Unknown balancers keep whatever check they have.
        keep |= {c.id for c in checks if c.balancer_id in desired.held}

        # 2. Records, in one change batch so the zone moves from one whole state to the next.
        changes: list[tuple[str, dict[str, Any]]] = []
        outcome: list[tuple[list[str], str]] = []
        for d in desired.records:
            if d.set_identifier not in check_for:
                continue
            want = _record_set(d, check_for[d.set_identifier])
            have = existing.get(d.set_identifier)
            if have is None:
                # UPSERT rather than CREATE: the same in Route53 for a new identifier, and
                # moto 5 refuses CREATE next to records of other identifiers.
                changes.append(("UPSERT", want))
                outcome.append((report.created, d.set_identifier))
            elif _same_record(have, want):
                report.unchanged.append(d.set_identifier)
            elif have.get("Type") == want["Type"] and "Region" in have:
                changes.append(("UPSERT", want))
                outcome.append((report.updated, d.set_identifier))
            else:
                # Another type or routing policy under the same identifier cannot be
                # upserted: replace it within the same batch.
                changes += [("DELETE", have), ("UPSERT", want)]
                outcome.append((report.updated, d.set_identifier))
        publish = {d.set_identifier for d in desired.records}
        for sid, have in sorted(existing.items()):
            if sid in publish:
                continue
            if sid in desired.held:
                report.unchanged.append(sid)
                keep.add(str(have.get("HealthCheckId")))
                continue
            changes.append(("DELETE", have))
            outcome.append((report.deleted, sid))
        failed = self._change(changes, report) if changes and not dry_run else set()
        for bucket, sid in outcome:
            if sid not in failed:
                bucket.append(sid)
        for sid in failed:
            # A record we could not repoint may still use its old check: keep them all.
            keep |= {c.id for c in checks if c.balancer_id == sid}

        # 3. Checks nothing refers to any more (after the records stopped using them).
        for c in checks:
            if c.id in keep:
                continue
            if not dry_run:
                try:
                    self.client.delete_health_check(HealthCheckId=c.id)
                except (ClientError, BotoCoreError) as exc:
                    report.errors.append(f"{c.balancer_id}: deleting health check {c.id}: "
                                         f"{_client_error_text(exc)}")
                    continue
            report.health_checks_deleted.append(c.balancer_id)

    def _create_check(self, spec: HealthCheckSpec) -> str:
        resp = self.client.create_health_check(
            CallerReference=_caller_reference(self.settings.name, spec.balancer_id),
            HealthCheckConfig=spec.config())
        hc_id = str(resp["HealthCheck"]["Id"])
        self.client.change_tags_for_resource(
            ResourceType="healthcheck", ResourceId=hc_id,
            AddTags=[{"Key": TAG_MANAGED, "Value": "skymesh"},
                     {"Key": TAG_RECORD, "Value": self.settings.name},
                     {"Key": TAG_BALANCER, "Value": spec.balancer_id},
                     {"Key": "Name", "Value": f"skymesh {spec.balancer_id}"}])
        return hc_id

    def _change(self, changes: list[tuple[str, dict[str, Any]]],
                report: SyncReport) -> set[str]:
        """Apply the changes; the balancer ids whose changes Route53 refused."""
        def batch(items: list[tuple[str, dict[str, Any]]]) -> None:
            self.client.change_resource_record_sets(
                HostedZoneId=self.zone_id(),
                ChangeBatch={"Comment": "skymesh dns sync",
                             "Changes": [{"Action": a, "ResourceRecordSet": r}
                                         for a, r in items]})

        try:
            batch(changes)
            return set()
        except ClientError:
            pass
        # The batch was refused as a whole: apply balancer by balancer so one bad record
        # does not hold back the others.
        by_sid: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for action, rrs in changes:
            by_sid.setdefault(rrs["SetIdentifier"], []).append((action, rrs))
        failed: set[str] = set()
        for sid, items in by_sid.items():
            try:
                batch(items)
            except ClientError as exc:
                report.errors.append(f"{sid}: {_client_error_text(exc)}")
                failed.add(sid)
        return failed


# -- the controller's hook -------------------------------------------------------------------

def make_client(cfg: Any) -> Any:
    """A Route53 client for these settings (``endpoint_url`` points it at moto in tests)."""
    import boto3

    settings = DnsSettings.of(cfg)
    return boto3.client("route53", region_name=settings.aws_region,
                        endpoint_url=settings.endpoint_url)


def sync_once(balancers: Iterable[Any], regions: Iterable[Any], cfg: Any,
              dry_run: bool = False, client: Any = None) -> dict[str, Any]:
    """Compute the desired state and reconcile the zone with it; the report as a dict."""
    desired = desired_state(balancers, regions, cfg)
    manager = Route53Manager(client if client is not None else make_client(cfg), cfg)
    return manager.sync(desired, dry_run=dry_run).to_dict()


def make_hook(cfg: Any, client: Any = None
              ) -> Callable[[list[Any], list[Any], bool], Awaitable[dict[str, Any]]]:
    """``async hook(balancers, regions, dry_run) -> report`` for the controller.

    boto3 blocks, so each sync runs in a worker thread; syncs never overlap (a lock), so
    two state changes in quick succession cannot interleave their Route53 calls.
    """
    settings = DnsSettings.of(cfg)
    route53 = client if client is not None else make_client(settings)
    lock = asyncio.Lock()

    async def hook(balancers: list[Any], regions: list[Any], dry_run: bool
                   ) -> dict[str, Any]:
        async with lock:
            return await asyncio.to_thread(sync_once, balancers, regions, settings,
                                           dry_run, route53)

    return hook
