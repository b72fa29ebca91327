"""The exporter-toolkit web configuration file (`--web.config.file`), read as node_exporter does.

Operators write one such file for TLS, client certificates and basic auth for all their
exporters; the same keys with the same meaning let them reuse it. `load` checks everything
at once (keys, types, files, certificates, keys, hashes) and raises `WebConfigError` listing
every problem, never showing a hash or key. Unlike exporter-toolkit the file is read once:
restart to pick up changes. Where Python's ssl differs from Go's, nothing is ignored silently:
- client_auth_type: NoClientCert -> CERT_NONE; VerifyClientCertIfGiven -> CERT_OPTIONAL and
  RequireAndVerifyClientCert -> CERT_REQUIRED, against the client CA they need. Request- and
  RequireAnyClientCert accept unverified certificates, which Python cannot: they are rejected.
- client_allowed_sans: checked after each handshake by the context's own SSL object and
  socket classes, so any server using `ssl_context()` (asyncio's too) enforces it.
- cipher_suites, curve_preferences (no preference list in Python's ssl) and rate_limit are
  rejected: OpenSSL's secure defaults apply, and there is no rate limiter here.
- http2 is accepted and has no effect: the exporter serves HTTP/1.1.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from dataloader_exporter.core.problems import Problems
from dataloader_exporter.exporter.web.basic_auth import MAX_COST, BasicAuth

TLS_SECTION = "tls_server_config"
TOP_KEYS = (TLS_SECTION, "http_server_config", "basic_auth_users", "rate_limit")
TLS_TEXT = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file",
            "client_auth_type", "min_version", "max_version")
TLS_LISTS = ("cipher_suites", "curve_preferences", "client_allowed_sans")
UNSUPPORTED = {"rate_limit": "no rate limiter here",
               f"{TLS_SECTION}.curve_preferences": "Python's ssl has no curve preference list",
               f"{TLS_SECTION}.cipher_suites": "OpenSSL's default suites apply"}
KINDS = {str: "a string", bool: "true or false", dict: "a mapping", list: "a list of strings"}
# exporter-toolkit's only configurable headers, with their allowed values (empty: any).
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (), "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": (),
    "Content-Security-Policy": ()}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
            "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
BCRYPT_HASH = re.compile(r"\$2[abxy]\$([0-9]{2})\$[./A-Za-z0-9]{53}")


class WebConfigError(Problems):
    """One or more problems with a web config file, one line each."""


@dataclass(frozen=True)
class TlsSettings:
    """TLS settings as loaded; paths are absolute, None where the PEM was given inline."""

    cert_file: str | None
    key_file: str | None
    client_auth_type: str
    client_ca_file: str | None
    min_version: ssl.TLSVersion
    max_version: ssl.TLSVersion
    prefer_server_cipher_suites: bool
    client_allowed_sans: frozenset[str]


@dataclass(frozen=True)
class WebConfig:
    """A loaded web config file. `http2` is informative only: the exporter serves HTTP/1.1."""

    path: str
    tls: TlsSettings | None
    users: Mapping[str, bytes] = field(repr=False)
    headers: Mapping[str, str]
    http2: bool = True
    _context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    _auth: BasicAuth = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_auth", BasicAuth(self.users))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side context, built once at load; None for plain HTTP."""
        return self._context

    def authorized(self, authorization: str | None) -> bool:
        """Whether a request with this raw Authorization header value may pass."""
        return self._auth.check(authorization)

    def known(self, authorization: str | None) -> bool:
        """Whether it may pass without a bcrypt check (no users, or a cached success):
        cheap enough to ask on the event loop."""
        return self._auth.known(authorization)


def load(path: str) -> WebConfig:
    """Read and check a web config file; raise WebConfigError listing every problem."""
    try:
        with open(path, "rb") as f:
            doc = yaml.load(f.read(), Loader=_StrictLoader)
    except OSError as e:
        raise WebConfigError([f"{path}: cannot read the file: {e.strerror}"]) from None
    except yaml.YAMLError as e:  # its own message quotes the line, which may hold a secret
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise WebConfigError([f"{path}: not valid YAML: {problem}{where}"]) from None
    if not isinstance(doc, dict | None):
        raise WebConfigError([f"{path}: the file must hold a mapping of settings"])
    r = _Report(path)
    doc = r.section({"": doc}, "", TOP_KEYS)  # "": the top level
    users: dict[str, bytes] = {}
    for user, hashed in (r.get(doc, "basic_auth_users", dict) or {}).items():
        if not isinstance(user, str) or not user or ":" in user:
            r.add(f"basic_auth_users.{user}", "a user name must be a non-empty string without ':'")
        elif not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed) or not (
                4 <= int(hashed[4:6]) <= MAX_COST):
            r.add(f"basic_auth_users.{user}", f"not a bcrypt hash of cost 04-{MAX_COST} "
                  "($2y$, 60 characters; a higher cost makes each check take seconds)")
        else:
            users[user] = hashed.encode()
    http = r.section(doc, "http_server_config", ("http2", "headers"))
    headers = r.get(http, "http_server_config.headers", dict) or {}
    for name, value in headers.items():
        where, allowed = f"http_server_config.headers.{name}", HEADERS.get(name)
        if allowed is None:
            r.add(where, f"this header cannot be set (only {', '.join(HEADERS)})")
        elif not isinstance(value, str) or not all(" " <= c <= "~" for c in value):
            r.add(where, "must be printable ASCII on one line (HTTP header values are)")
        elif allowed and value not in allowed:
            r.add(where, f"must be one of {', '.join(allowed)}")
    http2 = r.get(http, "http_server_config.http2", bool) is not False
    tls_keys = (*TLS_TEXT, *TLS_LISTS, "prefer_server_cipher_suites")
    tls, context = _tls(r.section(doc, TLS_SECTION, tls_keys),
                        os.path.dirname(os.path.abspath(path)), r)
    if r.problems:
        raise WebConfigError(r.problems)
    return WebConfig(path, tls, MappingProxyType(users), MappingProxyType(dict(headers)),
                     http2, context)


class _Report:
    """Collects problem lines, each naming the config file and the key."""

    def __init__(self, path: str) -> None:
        self.path, self.problems = path, list[str]()

    def add(self, key: str, message: str) -> None:
        self.problems.append(f"{self.path}: {key}: {message}")

    def get(self, mapping: dict[Any, Any], where: str, kind: type) -> Any:
        """mapping[key] (where is 'section.key') if of this kind; None if absent or not."""
        value: Any = mapping.get(where.rpartition(".")[2])
        strings = not isinstance(value, list) or all(isinstance(v, str) for v in value)
        if value is None or (isinstance(value, kind) and strings):
            return value
        self.add(where, f"must be {KINDS[kind]}")
        return None

    def section(self, mapping: dict[Any, Any], where: str, keys: tuple[str, ...]) -> Any:
        """A sub-mapping; unknown keys, and unsupported ones that are set, are problems."""
        section = self.get(mapping, where, dict) or {}
        for key, value in section.items():
            name = f"{where}.{key}".lstrip(".")
            if name in UNSUPPORTED and value:
                self.add(name, f"not supported by dataloader-exporter ({UNSUPPORTED[name]})")
            elif key not in keys:
                self.add(name, f"unknown key (known: {', '.join(keys)})")
        return section


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys, as Go's yaml.UnmarshalStrict does."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key.value!r}", key.start_mark)
                seen.add(key.value)
        return super().construct_mapping(node, deep)


def _tls_key(key: str) -> str:
    """A key of the TLS section, as problem lines name it."""
    return f"{TLS_SECTION}.{key}"


def _tls(s: dict[str, Any], base: str, r: _Report) -> tuple[TlsSettings | None, Any]:
    """The TLS settings and server context: (None, None) without settings or with problems."""
    if not any(v is not None for v in s.values()):
        return None, None
    before = len(r.problems)
    text = {k: r.get(s, _tls_key(k), str) for k in TLS_TEXT}
    lists = {k: tuple(r.get(s, _tls_key(k), list) or ()) for k in TLS_LISTS}
    files = {k: os.path.join(base, text[f"{k}_file"]) if text[f"{k}_file"] else None
             for k in ("cert", "key", "client_ca")}
    pems = {k: _read_pem(k, text[k], files[k], r) for k in files}
    for k in ("cert", "key"):
        if not (text[k] or files[k]):
            r.add(TLS_SECTION, f"missing one of {k} or {k}_file")
    auth = text["client_auth_type"] or "NoClientCert"
    has_ca = bool(text["client_ca"] or files["client_ca"])
    if auth in UNVERIFIED_AUTH:
        r.add(_tls_key("client_auth_type"), f"{auth} is not supported by dataloader-exporter "
              "(Python's ssl verifies any client certificate it asks for); use "
              "RequireAndVerifyClientCert")
    elif auth not in CLIENT_AUTH:
        r.add(_tls_key("client_auth_type"), f"unknown (one of {', '.join(CLIENT_AUTH)})")
    elif (auth == "NoClientCert") == has_ca:
        r.add(_tls_key("client_ca_file"), "a client CA needs a client_auth_type that verifies"
              if has_ca else f"needed by {auth}")
    versions = {k: VERSIONS.get(text[k] or default) for k, default in
                (("min_version", "TLS12"), ("max_version", "TLS13"))}
    for k, version in versions.items():
        if version is None:
            r.add(_tls_key(k), f"unknown TLS version (one of {', '.join(VERSIONS)})")
    low = versions["min_version"] or ssl.TLSVersion.TLSv1_2  # defaults only stand in where
    high = versions["max_version"] or ssl.TLSVersion.TLSv1_3  # a problem was reported
    if low > high:
        r.add(_tls_key("min_version"), "is above max_version")
    if lists["client_allowed_sans"] and auth != "RequireAndVerifyClientCert":
        r.add(_tls_key("client_allowed_sans"), "needs client_auth_type RequireAndVerifyClientCert")
    prefer = r.get(s, _tls_key("prefer_server_cipher_suites"), bool) is not False
    context = _ServerContext(ssl.PROTOCOL_TLS_SERVER)
    _load_pems(context, pems, files, r)
    if len(r.problems) > before:
        return None, None
    tls = TlsSettings(files["cert"], files["key"], auth, files["client_ca"], low, high, prefer,
                      frozenset(lists["client_allowed_sans"]))
    context.minimum_version, context.maximum_version = low, high
    context.verify_mode, context.allowed_sans = CLIENT_AUTH[auth], tls.client_allowed_sans
    if not prefer:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    return tls, context


def _read_pem(key: str, inline: str | None, path: str | None, r: _Report) -> bytes | None:
    if inline and path:
        r.add(_tls_key(key), f"give {key} or {key}_file, not both")
    elif path:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            r.add(_tls_key(f"{key}_file"), f"cannot read {path}: {e.strerror}")
    return inline.encode() if inline and not path else None


def _add_certs(context: ssl.SSLContext, pem: bytes) -> bool:
    try:
        context.load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError):
        return False
    return True


def _load_pems(context: ssl.SSLContext, pems: dict[str, bytes | None],
               files: dict[str, str | None], r: _Report) -> None:
    """Load the certificate, key and client CA, naming the key and file of any problem."""
    key_of = {k: _tls_key(f"{k}_file" if files[k] else k) for k in files}
    name = {k: files[k] or f"the inline {k}" for k in files}
    if pems["client_ca"] is not None and not _add_certs(context, pems["client_ca"]):
        r.add(key_of["client_ca"], f"{name['client_ca']} holds no PEM certificate")
    cert, key = pems["cert"], pems["key"]
    if cert is None or key is None:
        return
    if not _add_certs(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert):
        r.add(key_of["cert"], f"{name['cert']} holds no PEM certificate")
    elif b"ENCRYPTED PRIVATE KEY-----" in key or b"Proc-Type: 4,ENCRYPTED" in key:
        r.add(key_of["key"], f"{name['key']} is encrypted; give it unencrypted")
    else:
        with tempfile.TemporaryDirectory() as tmp:  # mode 0700, for inline PEM only
            paths = [files[k] or os.path.join(tmp, k) for k in ("cert", "key")]
            for k, path, pem in (("cert", paths[0], cert), ("key", paths[1], key)):
                if not files[k]:
                    with open(path, "wb") as f:
                        f.write(pem)
            try:  # a password, even empty, keeps OpenSSL from prompting on the terminal
                context.load_cert_chain(paths[0], paths[1], password=b"")
            except ssl.SSLError as e:
                r.add(key_of["key"], f"{name['key']} does not match {name['cert']}"
                      if e.reason == "KEY_VALUES_MISMATCH" else
                      f"{name['key']} holds no PEM private key")


def _check_sans(conn: ssl.SSLObject | ssl.SSLSocket) -> None:
    """Refuse a client certificate without a SAN in client_allowed_sans, as exporter-toolkit."""
    allowed = getattr(conn.context, "allowed_sans", None)
    if not allowed:
        return
    sans: Any = (conn.getpeercert() or {}).get("subjectAltName", ())
    if not {_san(kind, value) for kind, value in sans} & allowed:
        raise ssl.SSLCertVerificationError("client certificate has no SAN in client_allowed_sans")


def _san(kind: str, value: str) -> str | None:
    """A SAN as Go's x509 prints it (IPs in short form); None for kinds Go does not match."""
    if kind == "IP Address":
        try:
            return str(ipaddress.ip_address(value.strip()))
        except ValueError:
            return value
    return value if kind in ("DNS", "email", "URI") else None


class _SanCheckedObject(ssl.SSLObject):
    def do_handshake(self) -> None:
        super().do_handshake()
        _check_sans(self)


class _SanCheckedSocket(ssl.SSLSocket):
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_sans(self)


class _ServerContext(ssl.SSLContext):
    """A server context whose connections check client_allowed_sans after the handshake."""

    allowed_sans: frozenset[str] = frozenset()
    sslobject_class = _SanCheckedObject
    sslsocket_class = _SanCheckedSocket
