"""Development certificates and tokens: a CA, a server certificate, client certificates,
and a tokens file, for docker-compose.yml (``make certs``) and the security tests.

    python -m services.server.devcerts deploy/dev-certs kvtier replay-worker localhost

writes into the directory: ``ca.pem``, ``server.pem`` + ``server-key.pem`` (for the named
hosts, localhost and 127.0.0.1; it also serves as the server's client certificate towards
replay workers), ``client.pem`` + ``client-key.pem`` (CN ``acme-client``, mapped to tenant
acme), ``tokens.toml`` (the SHA-256 of each token only) and one ``<name>.token`` file per
token (``admin``, ``acme``, ``beta``, ``replay``) for ``--token-file``. Never for production:
the CA key is written beside them.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365
DEV_TOKENS = {"admin": ("", "admin"), "acme": ("acme", "tenant"), "beta": ("beta", "tenant"),
              "replay": ("", "replay")}
DEV_CLIENT_CN = "acme-client"


@dataclass(frozen=True)
class Issued:
    """A key and the certificate over it, in PEM."""

    key_pem: bytes
    cert_pem: bytes
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issued(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Issued:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return Issued(key_pem, cert.public_bytes(serialization.Encoding.PEM), key, cert)


def make_ca(cn: str = "kvtier dev CA", *, days: int = VALID_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _issued(key, cert)


def issue(ca: Issued, cn: str, hosts: tuple[str, ...] = (), *, days: int = VALID_DAYS
          ) -> Issued:
    """A certificate signed by ``ca`` for ``cn``, good for both ends of a TLS connection
    (the kvtier server is also a client of its replay workers); ``hosts``: DNS names and
    IP addresses it serves."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]),
                                        critical=False)
    return _issued(key, builder.sign(ca.key, hashes.SHA256()))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def token_digest(token: str) -> str:
    """What a tokens file stores for ``token``: its SHA-256 in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_toml(tokens: dict[str, tuple[str, str]],
                client_certs: dict[str, tuple[str, str]] | None = None) -> str:
    """A tokens file: ``tokens`` maps token -> (tenant, role); ``client_certs`` maps a
    certificate CN -> (tenant, role)."""
    lines = []
    for token, (tenant, role) in tokens.items():
        lines += ["[[token]]", f'sha256 = "{token_digest(token)}"', f'tenant = "{tenant}"',
                  f'role = "{role}"', ""]
    for cn, (tenant, role) in (client_certs or {}).items():
        lines += ["[[client_cert]]", f'cn = "{cn}"', f'tenant = "{tenant}"', f'role = "{role}"',
                  ""]
    return "\n".join(lines)


def _write(path: Path, data: bytes | str, private: bool = False) -> None:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    if private:
        path.chmod(0o600)


def write_dev_set(directory: Path, hosts: tuple[str, ...] = ()) -> dict[str, str]:
    """Write the development set described above; returns the tokens by name."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    server = issue(ca, "kvtier", (*hosts, "localhost", "127.0.0.1"))
    client = issue(ca, DEV_CLIENT_CN)
    _write(directory / "ca.pem", ca.cert_pem)
    _write(directory / "ca-key.pem", ca.key_pem, private=True)
    _write(directory / "server.pem", server.cert_pem)
    _write(directory / "server-key.pem", server.key_pem, private=True)
    _write(directory / "client.pem", client.cert_pem)
    _write(directory / "client-key.pem", client.key_pem, private=True)
    tokens = {name: secrets.token_urlsafe(32) for name in DEV_TOKENS}
    for name, token in tokens.items():
        _write(directory / f"{name}.token", token + "\n", private=True)
    _write(directory / "tokens.toml",
           tokens_toml({tokens[n]: who for n, who in DEV_TOKENS.items()},
                       {DEV_CLIENT_CN: ("acme", "tenant")}))
    return tokens


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m services.server.devcerts DIRECTORY [HOST...]", file=sys.stderr)
        return 2
    write_dev_set(Path(argv[0]), tuple(argv[1:]))
    print(f"development certificates and tokens written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
