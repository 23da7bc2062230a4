"""Where a balancer's TLS material lives: the mesh CA's certificate, its own certificate
and key (as written by ``skymesh certs``: ``DIR/ca.crt``, ``DIR/<id>.crt``,
``DIR/<id>.key``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CA_CERT = "ca.crt"
CA_KEY = "ca.key"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: str | Path, name: str) -> TlsFiles:
        d = Path(directory)
        return cls(ca=d / CA_CERT, cert=d / f"{name}.crt", key=d / f"{name}.key")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """``(ca, cert, key)`` PEM bytes, as gRPC's credential constructors take them."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()
