"""The exporter-toolkit web configuration file (`--web.config.file`), read as node_exporter does.

Operators already write one file for TLS, client certificates and basic auth for every
Prometheus exporter; reading the same keys with the same meaning lets them reuse it. Loading
checks everything at once (keys, types, files, certificates, keys, hashes) and raises
`WebConfigError` listing every problem; no message prints a password hash or key material.
Unlike exporter-toolkit, the file is read once: restart the exporter to pick up changes.

Python's ssl differs from Go's crypto/tls in places; nothing is ignored silently:
- client_auth_type: NoClientCert -> CERT_NONE, VerifyClientCertIfGiven -> CERT_OPTIONAL and
  RequireAndVerifyClientCert -> CERT_REQUIRED, both against the client CA (required).
  RequestClientCert and RequireAnyClientCert accept unverified certificates, which Python
  cannot do (it verifies whatever it requests): they are rejected.
- cipher_suites: Go's names map to OpenSSL's (TLS 1.0-1.2; TLS 1.3 suites are fixed, as in Go).
- client_allowed_sans: checked right after each handshake by the context's own socket and
  SSL object classes, so any server using `ssl_context()` (asyncio included) enforces it.
- curve_preferences and rate_limit are rejected: Python's ssl has no curve preference list,
  and rate limiting is not implemented here.
- http2 is accepted and has no effect: the exporter serves HTTP/1.1.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import re
import secrets
import ssl
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import bcrypt
import yaml

TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
TLS_KEYS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file",
            "client_auth_type", "min_version", "max_version", "cipher_suites",
            "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans")
HTTP_KEYS = ("http2", "headers")
# exporter-toolkit's only configurable headers, with their allowed values (None: any).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None, "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": None,
    "Content-Security-Policy": None}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
            "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# Go's tls.CipherSuites() names -> OpenSSL names; TLS 1.3 suites cannot be configured.
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
CIPHERS = {f"TLS_{go}": ossl for go, ossl in (
    ("RSA_WITH_AES_128_CBC_SHA", "AES128-SHA"), ("RSA_WITH_AES_256_CBC_SHA", "AES256-SHA"),
    ("RSA_WITH_AES_128_GCM_SHA256", "AES128-GCM-SHA256"),
    ("RSA_WITH_AES_256_GCM_SHA384", "AES256-GCM-SHA384"),
    ("ECDHE_ECDSA_WITH_AES_128_CBC_SHA", "ECDHE-ECDSA-AES128-SHA"),
    ("ECDHE_ECDSA_WITH_AES_256_CBC_SHA", "ECDHE-ECDSA-AES256-SHA"),
    ("ECDHE_RSA_WITH_AES_128_CBC_SHA", "ECDHE-RSA-AES128-SHA"),
    ("ECDHE_RSA_WITH_AES_256_CBC_SHA", "ECDHE-RSA-AES256-SHA"),
    ("ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "ECDHE-ECDSA-AES128-GCM-SHA256"),
    ("ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", "ECDHE-ECDSA-AES256-GCM-SHA384"),
    ("ECDHE_RSA_WITH_AES_128_GCM_SHA256", "ECDHE-RSA-AES128-GCM-SHA256"),
    ("ECDHE_RSA_WITH_AES_256_GCM_SHA384", "ECDHE-RSA-AES256-GCM-SHA384"),
    ("ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256", "ECDHE-RSA-CHACHA20-POLY1305"),
    ("ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256", "ECDHE-ECDSA-CHACHA20-POLY1305"))}
BCRYPT_HASH = re.compile(r"\$2[abxy]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
AUTH_CACHE_SIZE = 100  # successful checks remembered, as exporter-toolkit's cache


class WebConfigError(ValueError):
    """One or more problems with a web config file, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class TlsSettings:
    """The TLS settings as loaded; paths are absolute, None where the PEM was inline."""

    cert_file: str | None
    key_file: str | None
    client_auth_type: str
    client_ca_file: str | None
    min_version: ssl.TLSVersion
    max_version: ssl.TLSVersion
    cipher_suites: tuple[str, ...]
    prefer_server_cipher_suites: bool
    client_allowed_sans: tuple[str, ...]


class BasicAuth:
    """Checks Basic credentials against bcrypt hashes, remembering recent successes.

    bcrypt is slow on purpose, so a success is cached under the user and a SHA-256 of the
    password (bounded LRU); failures are not. An unknown user still costs one bcrypt check
    against a random hash of the highest configured cost, so timing does not reveal users.
    As in exporter-toolkit, one bcrypt check runs at a time. Thread-safe.
    """

    def __init__(self, users: Mapping[str, bytes], cache_size: int = AUTH_CACHE_SIZE) -> None:
        self.users = users
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._lock, self._bcrypt_lock = threading.Lock(), threading.Lock()
        cost = max((int(h[4:6]) for h in users.values()), default=4)
        self._dummy = bcrypt.hashpw(secrets.token_hex(16).encode(), bcrypt.gensalt(cost))

    def check(self, authorization: str | None) -> bool:
        """True for a valid `Basic` Authorization header value, or when no users are set."""
        if not self.users:
            return True
        credentials = parse_basic(authorization)
        if credentials is None:
            return False
        user, password = credentials
        key = (user, hashlib.sha256(password).digest())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return True
        hashed = self.users.get(user)
        ok = self.checkpw(password, self._dummy if hashed is None else hashed) and bool(hashed)
        if ok:
            with self._lock:
                self._cache[key] = None
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return ok

    def checkpw(self, password: bytes, hashed: bytes) -> bool:
        """One bcrypt comparison (bcrypt reads the first 72 bytes, as Go's does)."""
        with self._bcrypt_lock:
            try:
                return bcrypt.checkpw(password[:72], hashed)
            except ValueError:
                return False


def parse_basic(authorization: str | None) -> tuple[str, bytes] | None:
    """(user, password) from `Basic base64(user:password)`, None when malformed."""
    if not authorization or authorization[:6].lower() != "basic ":
        return None
    try:
        raw = base64.b64decode(authorization[6:], validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = raw.partition(b":")
    return (user.decode("utf-8", "surrogateescape"), password) if colon else None


@dataclass(frozen=True)
class WebConfig:
    """A loaded web config file. http2 is kept for reference only: we serve HTTP/1.1."""

    path: str
    tls: TlsSettings | None
    users: Mapping[str, bytes] = field(repr=False)
    headers: Mapping[str, str]
    http2: bool = True
    _context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    _auth: BasicAuth | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._auth is None:
            object.__setattr__(self, "_auth", BasicAuth(self.users))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side context built at load; None for plain HTTP."""
        return self._context

    def authorized(self, authorization: str | None) -> bool:
        """Whether a request with this raw Authorization header value may pass."""
        assert self._auth is not None
        return self._auth.check(authorization)


def load(path: str) -> WebConfig:
    """Read and check a web config file; raise WebConfigError listing every problem."""
    r = _Report(path)
    try:
        with open(path, "rb") as f:
            doc = yaml.load(f.read(), Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except OSError as e:
        raise WebConfigError([f"{path}: cannot read the file: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise WebConfigError([f"{path}: not valid YAML: {_yaml_reason(e)}"]) from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise WebConfigError([f"{path}: the file must hold a mapping of settings"])
    for key in doc.keys() - set(TOP_KEYS):
        r.add(str(key), f"unknown key (known: {', '.join(TOP_KEYS)})")
    if r.section(doc, "rate_limit", ("interval", "burst")):
        r.add("rate_limit", "not supported by dataloader-exporter; remove it")
    users = _users(doc.get("basic_auth_users"), r)
    http = r.section(doc, "http_server_config", HTTP_KEYS)
    http2 = r.get(http, "http_server_config", "http2", bool)
    headers = r.get(http, "http_server_config", "headers", dict) or {}
    for name, value in headers.items():
        allowed = HEADERS.get(name, ())
        where = f"http_server_config.headers.{name}"
        if name not in HEADERS:
            r.add(where, f"this header cannot be configured (allowed: {', '.join(HEADERS)})")
        elif not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            r.add(where, "must be a string on one line")
        elif allowed and value not in allowed:
            r.add(where, f"must be one of {', '.join(allowed)}")
    tls, context = _tls(r.section(doc, "tls_server_config", TLS_KEYS), path, r)
    if r.problems:
        raise WebConfigError(r.problems)
    return WebConfig(path, tls, MappingProxyType(users), MappingProxyType(dict(headers)),
                     http2 is not False, context)


class _Report:
    """Collects problem lines, each naming the file and the key."""

    def __init__(self, path: str) -> None:
        self.path, self.problems = path, []  # type: ignore[var-annotated]

    def add(self, key: str, message: str) -> None:
        self.problems.append(f"{self.path}: {key}: {message}")

    def section(self, doc: dict[Any, Any], name: str, keys: tuple[str, ...]) -> dict[Any, Any]:
        value = doc.get(name)
        if value is not None and not isinstance(value, dict):
            self.add(name, "must be a mapping")
        if not isinstance(value, dict):
            return {}
        for key in value.keys() - set(keys):
            self.add(f"{name}.{key}", f"unknown key (known: {', '.join(keys)})")
        return {k: v for k, v in value.items() if v is not None and k in keys}

    def get(self, section: dict[Any, Any], name: str, key: str, kind: type) -> Any:
        value = section.get(key)
        if value is None or isinstance(value, kind) and (
                kind is not list or all(isinstance(v, str) for v in value)):
            return value
        kinds = {str: "a string", bool: "true or false", dict: "a mapping",
                 list: "a list of strings"}
        self.add(f"{name}.{key}", f"must be {kinds[kind]}")
        return None


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys, as Go's yaml.UnmarshalStrict does."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key if isinstance(key, str | int | float | bool) else id(key_node))
        return super().construct_mapping(node, deep)


def _yaml_reason(e: yaml.YAMLError) -> str:
    """The reason and position only: YAML's own snippet could show a secret."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return type(e).__name__


def _users(value: Any, r: _Report) -> dict[str, bytes]:
    if value is not None and not isinstance(value, dict):
        r.add("basic_auth_users", "must be a mapping of user name to bcrypt hash")
    users = {}
    for user, hashed in (value or {}).items() if isinstance(value, dict) else ():
        where = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user:
            r.add(where, "a user name must be a non-empty string (quote it)")
        elif ":" in user:
            r.add(where, "a user name cannot contain ':' (Basic auth splits on it)")
        elif not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            r.add(where, "the password hash is not a bcrypt hash ($2y$, cost 04-31, 60 chars)")
        else:
            users[user] = hashed.encode()
    return users


def _tls(s: dict[str, Any], path: str, r: _Report) -> tuple[TlsSettings | None, Any]:
    if not s:
        return None, None
    base = os.path.dirname(os.path.abspath(path))
    get = {k: r.get(s, "tls_server_config", k, list if k in (
        "cipher_suites", "curve_preferences", "client_allowed_sans") else
        bool if k == "prefer_server_cipher_suites" else str) for k in TLS_KEYS}
    files = {k: os.path.join(base, get[k]) if get[k] else None
             for k in ("cert_file", "key_file", "client_ca_file")}
    pem = {k: _pem(get[k], files[f"{k}_file"], k, r) for k in ("cert", "key", "client_ca")}
    auth = get["client_auth_type"] or "NoClientCert"
    if auth in UNVERIFIED_AUTH:
        r.add("tls_server_config.client_auth_type", f"{auth} is not supported by "
              "dataloader-exporter: Python's ssl verifies any client certificate it asks "
              "for; use VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    elif auth not in CLIENT_AUTH:
        r.add("tls_server_config.client_auth_type", f"unknown value (one of {', '.join(
            [*CLIENT_AUTH, *UNVERIFIED_AUTH[:2]])})")
    elif (auth == "NoClientCert") == bool(pem["client_ca"]) and "client_ca" in pem:
        r.add("tls_server_config.client_ca_file", "a client CA needs a client_auth_type that "
              "verifies" if auth == "NoClientCert" else f"{auth} needs client_ca_file")
    versions = [VERSIONS.get(get[k] or d) for k, d in (("min_version", "TLS12"),
                                                      ("max_version", "TLS13"))]
    for key, version in zip(("min_version", "max_version"), versions):
        if version is None:
            r.add(f"tls_server_config.{key}", f"unknown version (one of {', '.join(VERSIONS)})")
    if None not in versions and versions[0] > versions[1]:  # type: ignore[operator]
        r.add("tls_server_config.min_version", "is above max_version")
    suites = tuple(get["cipher_suites"] or ())
    for name in suites:
        if name not in CIPHERS and name not in TLS13_SUITES:
            r.add("tls_server_config.cipher_suites", f"unknown cipher suite {name!r}")
    if get["curve_preferences"]:
        r.add("tls_server_config.curve_preferences", "not supported by dataloader-exporter "
              "(Python's ssl has no curve preference list); remove it")
    sans = tuple(get["client_allowed_sans"] or ())
    if sans and auth != "RequireAndVerifyClientCert":
        r.add("tls_server_config.client_allowed_sans", "needs client_auth_type "
              "RequireAndVerifyClientCert")
    if r.problems:
        return None, None
    settings = TlsSettings(files["cert_file"], files["key_file"], auth, files["client_ca_file"],
                           versions[0], versions[1], suites,  # type: ignore[arg-type]
                           get["prefer_server_cipher_suites"] is not False, sans)
    return settings, _context(settings, pem, r)
