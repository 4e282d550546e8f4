"""Development certificates and tokens: a CA, a server certificate, client certificates,
and a tokens file, for the compose files, the secured quickstart and the security tests.

    kvtier certs DIR [--name HOST]... [--force]
    python -m services.server.devcerts DIR ...   (the same command)

writes into DIR: ``ca.pem`` + ``ca-key.pem``, ``server.pem`` + ``server-key.pem`` (for
``DEFAULT_NAMES``, every name and address the compose files advertise, and each
``--name``; it also serves as the server's client certificate towards replay workers),
``client.pem`` + ``client-key.pem`` (CN ``acme-client``, mapped to tenant acme),
``tokens.toml`` (the SHA-256 of each token only) and one ``<name>.token`` file per token
(``admin``, ``acme``, ``beta``, ``replay``, ``peer``) for ``--token-file``. Keys and tokens are
0600. It refuses to replace any of them without ``--force``. Never for production: the
CA key is written beside them.
"""

from __future__ import annotations

import argparse
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
# The services docker-compose.yml and docker-compose.fleet.yml address by name, and the
# local host (tests/server/test_compose.py checks the compose files name no other).
DEFAULT_NAMES = ("kvtier", "kvtier-a", "kvtier-b", "replay-worker", "localhost", "127.0.0.1",
                 "::1")
DEV_TOKENS = {"admin": ("", "admin"), "acme": ("acme", "tenant"), "beta": ("beta", "tenant"),
              "replay": ("", "replay"), "peer": ("", "peer")}
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


def output_names() -> list[str]:
    """The files ``write_dev_set`` writes, by name."""
    return ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem",
            "client-key.pem", "tokens.toml", *(f"{name}.token" for name in DEV_TOKENS)]


def write_dev_set(directory: Path, hosts: tuple[str, ...] = ()) -> dict[str, str]:
    """Write the development set described above, the server certificate for ``hosts``
    and ``DEFAULT_NAMES``; returns the tokens by name. Replaces files already there."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    server = issue(ca, "kvtier", tuple(dict.fromkeys((*hosts, *DEFAULT_NAMES))))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write them (created)")
    parser.add_argument("--name", action="append", default=[], metavar="HOST",
                        help="also issue the server certificate for this DNS name or IP "
                        f"address (repeatable; always: {', '.join(DEFAULT_NAMES)})")
    parser.add_argument("--force", action="store_true",
                        help="replace the files of an earlier set in DIR")


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    problem = _refusal(args.directory, args.name, args.force)
    if problem:
        print(f"kvtier certs: {problem}", file=sys.stderr)
        return 2
    try:
        write_dev_set(directory, tuple(args.name))
    except OSError as exc:
        print(f"kvtier certs: cannot write {directory}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"development CA, certificates and tokens written to {directory} (never for "
          "production: the CA key is there too)")
    return 0


def _refusal(directory: str, names: list[str], force: bool) -> str | None:
    # A mistyped option would otherwise become a directory of keys (``./--help``).
    if directory.startswith("-"):
        return f"DIR {directory!r} starts with '-': name a directory (./{directory})"
    for name in names:
        if not name or name.startswith("-") or any(c.isspace() for c in name):
            return f"--name {name!r} is not a host name or IP address"
    path = Path(directory)
    if path.exists() and not path.is_dir():
        return f"{directory} exists and is not a directory"
    existing = [n for n in output_names() if (path / n).exists()]
    if existing and not force:
        return (f"{directory} already holds {', '.join(existing)}: pass --force to replace "
                "them (clients holding the old CA or tokens will be refused)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.server.devcerts",
                                     description="make a development CA, certificates and "
                                     "tokens (as `kvtier certs`)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
