"""TLS material of the embedded server: a CA generated once per data dir and a server certificate it signs.

The CA's key never leaves the data dir (mode 0600); clients get `ca.pem` and verify the server against it.
The server certificate names every address a client may dial (the listen host, loopback, the host names
and addresses of this machine) and is reissued when that set grows. An operator's own certificate is used
instead when `server.pem` and `server-key.pem` are put there by hand and `ca.pem` beside them.

Cluster routes (`ensure_route_certificates`) are TLS with mutual verification, zero-ops: every server of a
cluster derives the same route CA key from the cluster secret it already shares (blake3 of the secret, as a
P-256 scalar), so each node issues its own route certificate (both server and client use) under a CA all the
others trust, and nobody distributes a certificate. Without the secret nobody can issue one: a server that
does not know it can neither join (route authorization) nor pose as a member (route TLS).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TLS_DIR = "tls"
ROUTE_DIR = "route"  # under TLS_DIR
_VALID = datetime.timedelta(days=3650)
_OWN_MARK = "mesh-actor embedded nats-server"  # the subject of certificates we issued (reissued as needed)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def local_names(listen_host: str) -> list[str]:
    """Names and addresses a client may use to reach a server listening on `listen_host`."""
    names = {"localhost", "127.0.0.1", "::1"}
    if listen_host not in ("0.0.0.0", "::", ""):
        names.add(listen_host)
    names.add(socket.gethostname())
    names.add(socket.getfqdn())
    if listen_host in ("0.0.0.0", "::", ""):
        try:
            for info in socket.getaddrinfo(socket.gethostname(), None):
                names.add(str(info[4][0]))
        except OSError:
            pass
        names.update(primary_address())
    return sorted(n for n in names if n)


def primary_address() -> list[str]:
    """The address this machine sends from by default (a UDP `connect` sends nothing), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # only the route is looked up: nothing is sent
            return [str(probe.getsockname()[0])]
        except OSError:
            return []


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _named(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)
    }


def ensure_certificates(data_dir: Path, names: list[str]) -> TlsFiles:
    """The CA and server certificate under `data_dir/tls`, created or reissued so the server certificate
    names every one of `names`."""
    directory = data_dir / TLS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    files = TlsFiles(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server-key.pem")
    ca_key_path = directory / "ca-key.pem"
    now = datetime.datetime.now(datetime.UTC)
    if files.cert.exists() and files.key.exists() and files.ca.exists():
        current = x509.load_pem_x509_certificate(files.cert.read_bytes())
        own = _OWN_MARK in current.subject.rfc4514_string()
        if not own or (
            set(names) <= _named(current) and current.not_valid_after_utc > now + datetime.timedelta(days=30)
        ):
            return files  # the operator's own, or ours and still naming every address
    if ca_key_path.exists() and files.ca.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _ca_certificate(
            ca_key, f"{_OWN_MARK} CA", x509.random_serial_number(), now - datetime.timedelta(minutes=5), now + _VALID
        )
        _write_private(ca_key_path, ca_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ))  # fmt: skip
        _write_private(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    usages = [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    _issue(files, ca_key, ca_cert, _OWN_MARK, names, usages, now)
    return files


def _ca_certificate(
    key: ec.EllipticCurvePrivateKey, name: str, serial: int, start: datetime.datetime, end: datetime.datetime
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _issue(
    files: TlsFiles,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    name: str,
    names: list[str],
    usages: list[x509.ObjectIdentifier],
    now: datetime.datetime,
) -> None:
    """A fresh key and a certificate for it, signed by the CA, naming `names`; both written (0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(files.key, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))  # fmt: skip
    _write_private(files.cert, cert.public_bytes(serialization.Encoding.PEM))


_ROUTE_CA_DOMAIN = b"mesh-actor/cluster-route-ca/v1\x00"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def route_files(data_dir: Path) -> TlsFiles:
    directory = data_dir / TLS_DIR / ROUTE_DIR
    return TlsFiles(ca=directory / "ca.pem", cert=directory / "route.pem", key=directory / "route-key.pem")


def route_ca_key(secret: str) -> ec.EllipticCurvePrivateKey:
    """The cluster's route CA key: the same on every server that knows the secret, on no other."""
    digest = blake3.blake3(_ROUTE_CA_DOMAIN + secret.encode()).digest(length=64)
    scalar = int.from_bytes(digest, "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def ensure_route_certificates(data_dir: Path, secret: str, names: list[str]) -> TlsFiles:
    """The route CA (derived from `secret`) and this server's route certificate under `data_dir/tls/route`,
    created or reissued when the secret changed or the certificate does not name every one of `names`."""
    files = route_files(data_dir)
    files.ca.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(files.ca.parent.parent, 0o700)
    ca_key = route_ca_key(secret)
    public = ca_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    now = datetime.datetime.now(datetime.UTC)
    if files.cert.exists() and files.key.exists() and files.ca.exists():
        ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
        current = x509.load_pem_x509_certificate(files.cert.read_bytes())
        same_ca = (
            ca.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            == public
        )
        if (
            same_ca
            and set(names) <= _named(current)
            and current.not_valid_after_utc > now + datetime.timedelta(days=30)
        ):
            return files
    serial = int.from_bytes(blake3.blake3(public).digest(length=16), "big") >> 1
    start, end = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), datetime.datetime(2126, 1, 1, tzinfo=datetime.UTC)
    ca_cert = _ca_certificate(ca_key, f"{_OWN_MARK} cluster route CA", serial, start, end)
    usages = [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    _issue(files, ca_key, ca_cert, f"{_OWN_MARK} route", names, usages, now)
    _write_private(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    return files
