"""``skymesh certs``: a private CA for the mesh and one certificate per balancer.

Peers authenticate each other with mutual TLS. Each balancer's certificate carries its
balancer id as the subject CN (what the peer's allow-list checks) and as a DNS SAN (what
the connecting side verifies, via gRPC's target-name override, so the address may be
anything), plus IP SANs (127.0.0.1 by default, so loopback works without the override).
Keys are ECDSA P-256 (small, fast handshakes) and written 0600; certificates are good
for both server and client auth, since every balancer is both.

    skymesh certs --out DIR --ca                      # DIR/ca.crt, DIR/ca.key
    skymesh certs --out DIR --name lb-us --name lb-eu  # DIR/lb-us.{crt,key}, ...
    skymesh certs --out DIR --ca --name lb-us --ip 10.0.0.5 --dns lb-us.example.com

An existing CA is never overwritten without ``--force`` (that would orphan every
certificate it signed); a balancer certificate is simply reissued.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from skymesh.mesh.tls import CA_CERT, CA_KEY, TlsFiles

DEFAULT_CA_NAME = "skymesh-ca"
DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 825
MAX_DAYS = 825  # what --days accepts (the CA's own default, 3650, is not user-set)
DEFAULT_IPS = ("127.0.0.1",)
# A balancer id is a file name and a DNS SAN: keep it to DNS-safe characters.
_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$")
_SKEW = dt.timedelta(minutes=5)  # tolerate peers whose clocks run a little behind


class CertError(Exception):
    pass


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise CertError(f"invalid balancer id {name!r}: use letters, digits, '.' and '-'")
    return name


def _write(path: Path, data: bytes, mode: int) -> None:
    # Create the temp file with its final mode, so a key is never readable by others.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(out: str | Path, *, name: str = DEFAULT_CA_NAME, days: int = DEFAULT_CA_DAYS,
              force: bool = False) -> tuple[Path, Path]:
    """A self-signed CA in ``out``; returns ``(ca.crt, ca.key)``."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    crt, key_path = d / CA_CERT, d / CA_KEY
    if not force and (crt.exists() or key_path.exists()):
        raise CertError(f"{crt} already exists (use --force to replace the CA and "
                        "invalidate every certificate it signed)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now - _SKEW + dt.timedelta(days=days))  # exactly `days` long
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), 0o600)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return crt, key_path


def issue_cert(out: str | Path, name: str, *, ips: Sequence[str] = DEFAULT_IPS,
               dns: Sequence[str] = (), days: int = DEFAULT_CERT_DAYS,
               ca_dir: str | Path | None = None) -> TlsFiles:
    """A certificate for balancer ``name`` signed by the CA in ``ca_dir`` (default ``out``)."""
    _check_name(name)
    d = Path(out)
    cd = Path(ca_dir) if ca_dir is not None else d
    try:
        ca_cert = x509.load_pem_x509_certificate((cd / CA_CERT).read_bytes())
        ca_key = serialization.load_pem_private_key((cd / CA_KEY).read_bytes(), None)
    except FileNotFoundError:
        raise CertError(f"no CA in {cd}: create one first with --ca") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{cd / CA_KEY}: expected an EC key")
    try:
        addrs = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as exc:
        raise CertError(str(exc)) from None
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([name, *dns])]
    sans += [x509.IPAddress(a) for a in addrs]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now - _SKEW + dt.timedelta(days=days))  # exactly `days` long
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_agreement=True,
            content_commitment=False, data_encipherment=False, key_cert_sign=False,
            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(ca=cd / CA_CERT, cert=d / f"{name}.crt", key=d / f"{name}.key")
    _write(files.key, _key_pem(key), 0o600)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def run(args: argparse.Namespace) -> int:
    """The ``skymesh certs`` command (its flags are declared in :mod:`skymesh.cli`)."""
    if not args.ca and not args.name:
        print("skymesh certs: nothing to do: give --ca and/or --name", file=sys.stderr)
        return 2
    if args.days is not None and not 1 <= args.days <= MAX_DAYS:
        # 825 days is the longest validity clients accept for a leaf certificate (CA/B
        # Forum, Apple); 0 used to mean "the default" and a negative number crashed.
        print(f"skymesh certs: --days must be between 1 and {MAX_DAYS}, not {args.days}",
              file=sys.stderr)
        return 2
    try:
        if args.ca:
            crt, key = create_ca(args.out, days=args.days if args.days is not None
                                 else DEFAULT_CA_DAYS, force=args.force)
            print(f"CA: {crt} (key {key})")
        for name in args.name:
            files = issue_cert(args.out, name, ips=args.ip or DEFAULT_IPS, dns=args.dns,
                               days=args.days if args.days is not None
                               else DEFAULT_CERT_DAYS)
            print(f"{name}: {files.cert} (key {files.key})")
    except CertError as exc:
        print(f"skymesh certs: {exc}", file=sys.stderr)
        return 2
    return 0
