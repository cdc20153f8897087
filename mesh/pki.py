"""The mesh CA: one certificate authority per mesh, and a leaf certificate per service kind.

`infermesh up` calls `ensure_mesh_ca(home()/"mesh-ca", hosts)` once; the layout is

    mesh-ca/ca.key, ca.crt           the CA (key 0600; it never leaves this folder)
    mesh-ca/<kind>/ca.crt, tls.crt, tls.key    for cache, tokenizer, engine, router, edge, client

so a service's `--tls-dir` is `mesh-ca/<kind>` (the same files a Kubernetes TLS Secret holds).  Each
leaf is good for both sides of a connection (serverAuth and clientAuth), names its kind in the
subject CN (for per-caller authorization later) and carries the SANs MESH_NAME, localhost,
127.0.0.1 and every host given.  `client` is for operators: `infermesh top`, tests, scripts
(INFERMESH_MESH_TLS_DIR=mesh-ca/client).  Existing files are kept while valid, so restarts and
concurrent `up`s (an exclusive lock) share one CA; a leaf missing a host is reissued.

`python -m mesh.pki DIR [--host H ...]` writes the same layout for compose or Kubernetes Secrets.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.credentials import CA_FILE, CERT_FILE, KEY_FILE, MESH_NAME
from mesh.files import exclusive_lock, write_atomic

KINDS = ("cache", "tokenizer", "engine", "router", "edge", "client")
CA_KEY = "ca.key"
CA_DAYS, LEAF_DAYS = 3650, 825
RENEW_BEFORE = datetime.timedelta(days=30)


def ensure_mesh_ca(root: str | Path, hosts: Sequence[str] = ()) -> Path:
    """The mesh CA under `root` and a leaf per kind covering `hosts`, made or reissued as needed."""
    root = Path(root)
    with exclusive_lock(root / ".lock"):
        ca_key, ca_cert = _ca(root)
        ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        names = _names(hosts)
        for kind in KINDS:
            folder = root / kind
            if not _leaf_ok(folder, ca_cert, names):
                key, cert = issue(ca_key, ca_cert, kind, names)
                write_atomic(folder / KEY_FILE, _key_pem(key), mode=0o600)
                write_atomic(folder / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM))
            if not (folder / CA_FILE).exists() or (folder / CA_FILE).read_bytes() != ca_pem:
                write_atomic(folder / CA_FILE, ca_pem)
    return root


def new_ca(common_name: str = "infermesh mesh CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, kind: str, names: Sequence[str]
          ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf for `kind`, signed by the CA, for both server and client use, with SANs `names`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, kind)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _names(hosts: Sequence[str]) -> list[str]:
    """MESH_NAME, the loopback names and each host (a HOST:PORT loses its port), once each."""
    names = [MESH_NAME, "localhost", "127.0.0.1"]
    for host in hosts:
        host = host.strip()
        if host.count(":") == 1:                # HOST:PORT; an IPv6 address has several colons
            host = host.partition(":")[0]
        host = host.strip("[]")
        if host and host not in ("0.0.0.0", "::") and host not in names:
            names.append(host)
    return names


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(root: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_file, cert_file = root / CA_KEY, root / CA_FILE
    if key_file.exists() and cert_file.exists():
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        if isinstance(key, ec.EllipticCurvePrivateKey) and _fresh(cert):
            return key, cert
    key, cert = new_ca()
    write_atomic(key_file, _key_pem(key), mode=0o600)
    write_atomic(cert_file, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > RENEW_BEFORE


def _leaf_ok(folder: Path, ca_cert: x509.Certificate, names: Sequence[str]) -> bool:
    """The leaf in `folder` exists, was issued by this CA, is not near expiry and covers `names`."""
    try:
        cert = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
        (folder / KEY_FILE).stat()
    except (OSError, ValueError):
        return False
    if cert.issuer != ca_cert.subject or not _fresh(cert):
        return False
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError):
        return False
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    have = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    have |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    return set(names) <= have


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mesh.pki", description="write a mesh CA and a leaf per service kind")
    p.add_argument("folder")
    p.add_argument("--host", action="append", default=[], help="a SAN for every leaf (service DNS name, IP)")
    a = p.parse_args(argv)
    print(ensure_mesh_ca(a.folder, a.host))


if __name__ == "__main__":
    main()
