"""The edge's TLS certificate for HTTP/3: self-signed for localhost, made once and shared.

HTTP/3 has no plaintext mode, so a mesh on one machine needs a certificate before its first start;
its clients skip verification or trust this file (the edge logs where it is).
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mesh.files import exclusive_lock, write_atomic


def ensure_self_signed_cert(directory: str) -> tuple[str, str]:
    """Create (once) a self-signed localhost cert/key in `directory`; return their paths."""
    os.makedirs(directory, exist_ok=True)
    certfile, keyfile = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    # Several services may start at once; the lock stops them writing mismatched pairs.
    with exclusive_lock(os.path.join(directory, ".cert.lock")):
        if os.path.exists(certfile) and os.path.exists(keyfile):
            return certfile, keyfile
        key_pem, cert_pem = self_signed_pair()
        write_atomic(keyfile, key_pem, 0o600)           # never readable by others, not even briefly
        write_atomic(certfile, cert_pem, 0o644)
    return certfile, keyfile


def self_signed_pair() -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM): P-256, valid a year for localhost, 127.0.0.1 and ::1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))  # tolerate clock skew
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)
