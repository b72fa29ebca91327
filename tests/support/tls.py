"""Test certificates made with the real `openssl` command: a CA, a server certificate for
localhost and 127.0.0.1, a client certificate from that CA, and an unrelated CA with its own
client. EC P-256 keys keep generation fast (a few milliseconds each)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLIENT_SANS = ("DNS:client.example.com,URI:spiffe://example.com/trainer,email:ops@example.com,"
               "IP:2001:db8::1")
OTHER_CLIENT_SANS = "DNS:intruder.example.com"

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
extendedKeyUsage = {usage}
subjectAltName = {sans}
"""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: cert and key of each party; `other_*` come from an unrelated CA."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path
    other_client_cert: Path
    other_client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate every file into `directory` (skips the test when openssl is missing)."""
    if shutil.which("openssl") is None:
        from support.required import require_binary

        require_binary("openssl")  # a failure in CI, a skip elsewhere
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    other_ca = _ca(directory, "other-ca")
    server = _leaf(directory, "server", ca, "serverAuth", "DNS:localhost,IP:127.0.0.1")
    client = _leaf(directory, "client", ca, "clientAuth", CLIENT_SANS)
    other = _leaf(directory, "other-client", other_ca, "clientAuth", OTHER_CLIENT_SANS)
    return TlsFiles(ca[0], *server, *client, other_ca[0], *other)


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)


def _key(directory: Path, name: str) -> Path:
    key = directory / f"{name}.key"
    _openssl(directory, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(key))
    return key


def _config(directory: Path, name: str, usage: str = "serverAuth", sans: str = "") -> Path:
    config = directory / f"{name}.cnf"
    text = _CONFIG.format(usage=usage, sans=sans or "DNS:unused")
    config.write_text(text)
    return config


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = _key(directory, name), directory / f"{name}.crt"
    _openssl(directory, "req", "-x509", "-new", "-key", str(key), "-out", str(cert),
             "-days", "2", "-subj", f"/CN=dataloader-exporter test {name}",
             "-config", str(_config(directory, name)), "-extensions", "ca")
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], usage: str,
          sans: str) -> tuple[Path, Path]:
    key, cert, csr = _key(directory, name), directory / f"{name}.crt", directory / f"{name}.csr"
    config = _config(directory, name, usage, sans)
    _openssl(directory, "req", "-new", "-key", str(key), "-out", str(csr),
             "-subj", f"/CN={name}", "-config", str(config))
    _openssl(directory, "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-set_serial", str(secrets.randbits(63)), "-days", "2", "-out", str(cert),
             "-extfile", str(config), "-extensions", "leaf")
    return cert, key
