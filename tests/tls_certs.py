"""Certificates for TLS tests, made on the spot with `cryptography` (EC P-256, one day valid)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH


@dataclass
class CertFiles:
    cert: Path
    key: Path


@dataclass
class CA:
    name: str
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(out: Path, name: str) -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    path = _write(out / f"{name}.ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return CA(name, cert, key, path)


def issue(ca: CA, out: Path, cn: str, *, client: bool = False) -> CertFiles:
    """A leaf certificate for localhost and 127.0.0.1 (server) or for a client named ``cn``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else SERVER_AUTH]),
            critical=False,
        )
    )
    if not client:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(ca.key, hashes.SHA256())
    stem = f"{ca.name}.{cn}"
    return CertFiles(
        cert=_write(out / f"{stem}.crt.pem", cert.public_bytes(serialization.Encoding.PEM)),
        key=_write(out / f"{stem}.key.pem", _key_pem(key)),
    )


@dataclass
class TLSMaterial:
    ca: CA
    other_ca: CA  # an unrelated CA: its certificates must be refused
    server: CertFiles
    client: CertFiles
    rogue_client: CertFiles  # signed by other_ca
    rogue_server: CertFiles


def make_tls_material(out: Path) -> TLSMaterial:
    ca, other = make_ca(out, "test-ca"), make_ca(out, "other-ca")
    return TLSMaterial(
        ca=ca,
        other_ca=other,
        server=issue(ca, out, "server"),
        client=issue(ca, out, "client-a", client=True),
        rogue_client=issue(other, out, "client-x", client=True),
        rogue_server=issue(other, out, "server"),
    )
