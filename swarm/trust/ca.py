"""The swarm CA: transport identities for mutual TLS between nodes and the trainer.

A node's identity (node id, region, role) is bound to an X.509 certificate
that the swarm CA issued, and TLS proves on every connection that the peer
holds the matching private key. So a node id that a ban or a REPORT names is
one nobody else can claim, and a relayed or spliced handshake fails in TLS
itself (the keys of a TLS 1.3 session are bound to that connection).

Certificates: ECDSA P-256 keys (fast handshakes, supported by every TLS
stack), the identity in the subject alternative names as URIs::

    patchswarm:node:<node id>     patchswarm:region:<region>     patchswarm:role:<node|origin>

We use Python's ``ssl`` (OpenSSL) for the protocol and ``cryptography`` for
keys and certificates: both well kept, neither hand-rolled. The contexts made
here speak TLS 1.3 only and require a certificate from the swarm CA on both
sides; host names are not checked, identities are (``peer_identity``).
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ConfigError

CA_KEY = "ca.key"
CA_CERT = "ca.crt"
URI_PREFIX = "patchswarm:"
ROLES = ("node", "origin")
MAX_ID = 128


@dataclass(frozen=True)
class Identity:
    """Who is at the other end of an authenticated connection."""

    node_id: str
    region: str
    role: str


def _check_name(value: str, what: str) -> str:
    ok = (0 < len(value) <= MAX_ID and value.isascii() and value.isprintable()
          and not any(c in value for c in " :/\\"))
    if not ok:
        raise ConfigError(f"{what} {value!r}: 1..{MAX_ID} printable ASCII characters, "
                          "no spaces, ':', '/' or '\\'")
    return value


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_public(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_ca(directory: str | Path, *, name: str = "patchswarm swarm CA",
            days: int = 3650) -> tuple[Path, Path]:
    """Create ``ca.key`` (0600) and ``ca.crt`` in ``directory``; refuses to overwrite."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    key_path, cert_path = directory / CA_KEY, directory / CA_CERT
    for p in (key_path, cert_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; refusing to overwrite a CA")
    if days < 1:
        raise ConfigError(f"--days must be at least 1, not {days}")
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _pem_key(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _load_ca(ca_dir: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc.filename}: no such file (run `patchswarm ca init`)") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{ca_dir}: not a patchswarm CA ({exc})") from None
    return key, cert


def issue(ca_dir: str | Path, node_id: str, *, region: str, role: str = "node",
          out_dir: str | Path, days: int = 365) -> tuple[Path, Path]:
    """Issue ``<node_id>.key`` (0600) and ``<node_id>.crt`` into ``out_dir``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    _check_name(node_id, "node id")
    _check_name(region, "region")
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if days < 1:
        raise ConfigError(f"--days must be at least 1, not {days}")
    ca_key, ca_cert = _load_ca(Path(ca_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key_path, cert_path = out / f"{node_id}.key", out / f"{node_id}.crt"
    for p in (key_path, cert_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; refusing to overwrite")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    sans = [x509.UniformResourceIdentifier(f"{URI_PREFIX}{k}:{v}")
            for k, v in (("node", node_id), ("region", region), ("role", role))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(key_path, _pem_key(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def identity_of(der: bytes) -> Identity:
    """The identity in a certificate the TLS layer already verified against the CA."""
    from cryptography import x509

    try:
        cert = x509.load_der_x509_certificate(der)
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.UniformResourceIdentifier)
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ConfigError(f"peer certificate carries no patchswarm identity ({exc})") from None
    fields: dict[str, str] = {}
    for uri in uris:
        if uri.startswith(URI_PREFIX):
            k, _, v = uri[len(URI_PREFIX):].partition(":")
            if k in fields:
                raise ConfigError(f"peer certificate names its {k} twice")
            fields[k] = v
    try:
        ident = Identity(_check_name(fields["node"], "node id"),
                         _check_name(fields["region"], "region"), fields["role"])
    except KeyError as exc:
        raise ConfigError(f"peer certificate carries no patchswarm {exc.args[0]}") from None
    if ident.role not in ROLES:
        raise ConfigError(f"peer certificate names an unknown role {ident.role!r}")
    return ident


def identity_of_pem(pem: bytes) -> Identity:
    """The identity in a PEM certificate file (ours: checked against the config)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise ConfigError(f"not a PEM certificate ({exc})") from None
    return identity_of(cert.public_bytes(Encoding.DER))


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> Identity:
    """The verified identity of the peer of a TLS connection."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise ConfigError("connection presented no certificate")
    return identity_of(der)


def _context(purpose: ssl.Purpose, ca_cert: Path, cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                         else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # identities are checked (peer_identity), not DNS names
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=str(ca_cert))
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc.filename}: no such file") from None
    except ssl.SSLError as exc:
        raise ConfigError(f"TLS credentials {cert} / {key} / {ca_cert}: {exc.reason or exc}") from None
    return ctx


def server_context(ca_cert: str | Path, cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """Accepts only peers with a certificate from the swarm CA (TLS 1.3)."""
    return _context(ssl.Purpose.CLIENT_AUTH, Path(ca_cert), Path(cert), Path(key))


def client_context(ca_cert: str | Path, cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """Dials only peers with a certificate from the swarm CA, presenting ours (TLS 1.3)."""
    return _context(ssl.Purpose.SERVER_AUTH, Path(ca_cert), Path(cert), Path(key))
