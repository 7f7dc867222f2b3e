"""Throw-away TLS for the bus: a fresh CA and a server certificate per run (``ceaseless up
--tls``), so traffic between pods and the control plane is encrypted and the server is
authenticated without anyone managing certificates. Needs ``cryptography``
(``pip install 'ceaseless[tls]'``). For a real deployment bring your own certificates (see
deploy/nats.conf) and set ``CEASELESS_TLS_CA`` to the CA bundle clients should trust.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

CA_ENV = "CEASELESS_TLS_CA"


@dataclass(frozen=True)
class TLSFiles:
    ca: Path      # the CA certificate clients trust
    cert: Path    # the server certificate (signed by the CA)
    key: Path     # the server key (mode 0600)


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
             days: int = 7) -> TLSFiles:
    """A new CA and a server certificate for ``hosts`` (IPs or DNS names) in ``directory``.
    The CA key is not kept: nothing else can be signed with it after this returns."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--tls needs the 'cryptography' package: "
                           "pip install 'ceaseless[tls]'") from e
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ceaseless run CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            # client auth too: clustered nats-servers present it to each other on routes,
            # which nats-server always verifies both ways
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))

    files = TLSFiles(ca=directory / "ca.pem", cert=directory / "server.pem",
                     key=directory / "server-key.pem")
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(files.key, key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()), private=True)
    return files


def client_context(ca: str | Path | None = None) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca`` (default: env
    ``CEASELESS_TLS_CA``, else the system's trust store)."""
    ca = ca or os.environ.get(CA_ENV) or None
    return ssl.create_default_context(cafile=str(ca) if ca else None)


def client_options(ca: str | Path | None) -> dict:
    """``Bus.connect`` keyword arguments for a run whose bus uses ``ca`` (None: plain)."""
    return {"tls": client_context(ca)} if ca else {}
