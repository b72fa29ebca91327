"""The exporter-toolkit web config file: loading, problems, TLS handshakes and basic auth."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bcrypt
import pytest
from support.tls import TlsFiles, make_tls_files

from dataloader_exporter.exporter.web.basic_auth import BasicAuth
from dataloader_exporter.exporter.web.webconfig import WebConfig, WebConfigError, load

PASSWORD = b"correct horse"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def write(directory: Path, text: str, name: str = "web.yml") -> str:
    path = directory / name
    path.write_text(text)
    return str(path)


def tls_yaml(certs: TlsFiles, extra: str = "") -> str:
    return (f"tls_server_config:\n  cert_file: {certs.server_cert}\n"
            f"  key_file: {certs.server_key}\n{extra}")


def basic(user: str, password: bytes) -> str:
    return "Basic " + base64.b64encode(user.encode() + b":" + password).decode()


def problems(path: str) -> list[str]:
    with pytest.raises(WebConfigError) as caught:
        load(path)
    assert str(caught.value) == "\n".join(caught.value.problems)
    return caught.value.problems


def client_context(certs: TlsFiles, cert: Path | None = None, key: Path | None = None
                   ) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca_cert))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def handshake(server: ssl.SSLContext | None, client: ssl.SSLContext
              ) -> tuple[bytes | Exception, Exception | None]:
    """What the client reads (b"ok" when the server accepted it), and the server's error."""
    assert server is not None
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    theirs.settimeout(10)
    server_error: list[Exception] = []

    def serve() -> None:
        try:
            with server.wrap_socket(theirs, server_side=True) as conn:
                conn.sendall(b"ok")
        except OSError as e:  # ssl.SSLError included
            server_error.append(e)
        finally:
            theirs.close()

    thread = threading.Thread(target=serve)
    thread.start()
    got: bytes | Exception
    try:
        with client.wrap_socket(ours, server_hostname="localhost") as conn:
            got = conn.recv(2)
    except OSError as e:
        got = e
    finally:
        ours.close()
    thread.join(10)
    return got, (server_error[0] if server_error else None)


def test_an_empty_file_or_an_empty_mapping_means_plain_http_without_auth(tmp_path: Path) -> None:
    for text in ("", "{}\n", "tls_server_config:\nbasic_auth_users: {}\n"):
        config = load(write(tmp_path, text))
        assert config.tls is None and config.ssl_context() is None
        assert dict(config.users) == {} and dict(config.headers) == {}
        assert config.authorized(None) and config.authorized("Basic garbage")


def test_a_valid_tls_and_auth_file_loads_and_serves_a_real_handshake(
        tmp_path: Path, certs: TlsFiles) -> None:
    path = write(tmp_path, tls_yaml(certs) + f"basic_auth_users:\n  alice: {HASH}\n"
                 "http_server_config:\n  http2: true\n  headers:\n"
                 "    X-Frame-Options: deny\n    Strict-Transport-Security: max-age=31536000\n")
    config = load(path)
    assert config.path == path and config.tls is not None
    assert config.tls.client_auth_type == "NoClientCert"
    assert config.tls.min_version == ssl.TLSVersion.TLSv1_2
    assert dict(config.headers) == {"X-Frame-Options": "deny",
                                    "Strict-Transport-Security": "max-age=31536000"}
    assert config.ssl_context() is config.ssl_context()
    assert handshake(config.ssl_context(), client_context(certs)) == (b"ok", None)
    assert HASH not in repr(config)


def test_require_and_verify_client_cert_accepts_the_cas_client_and_rejects_others(
        tmp_path: Path, certs: TlsFiles) -> None:
    config = load(write(tmp_path, tls_yaml(certs, "  client_auth_type: RequireAndVerifyClientCert\n"
                                                  f"  client_ca_file: {certs.ca_cert}\n")))
    assert config.ssl_context().verify_mode == ssl.CERT_REQUIRED  # type: ignore[union-attr]
    good = client_context(certs, certs.client_cert, certs.client_key)
    assert handshake(config.ssl_context(), good) == (b"ok", None)
    other = client_context(certs, certs.other_client_cert, certs.other_client_key)
    got, error = handshake(config.ssl_context(), other)
    assert got != b"ok" and isinstance(error, ssl.SSLCertVerificationError)
    got, error = handshake(config.ssl_context(), client_context(certs))
    assert got != b"ok" and isinstance(error, ssl.SSLError)  # no certificate at all


def test_verify_client_cert_if_given_lets_clients_without_one_in_but_checks_any_given(
        tmp_path: Path, certs: TlsFiles) -> None:
    config = load(write(tmp_path, tls_yaml(certs, "  client_auth_type: VerifyClientCertIfGiven\n"
                                                  f"  client_ca_file: {certs.ca_cert}\n")))
    assert config.ssl_context().verify_mode == ssl.CERT_OPTIONAL  # type: ignore[union-attr]
    assert handshake(config.ssl_context(), client_context(certs)) == (b"ok", None)
    other = client_context(certs, certs.other_client_cert, certs.other_client_key)
    got, error = handshake(config.ssl_context(), other)
    assert got != b"ok" and isinstance(error, ssl.SSLCertVerificationError)


def test_client_allowed_sans_are_enforced_by_an_asyncio_server(
        tmp_path: Path, certs: TlsFiles) -> None:
    def config(san: str) -> WebConfig:
        return load(write(tmp_path, tls_yaml(
            certs, "  client_auth_type: RequireAndVerifyClientCert\n"
            f"  client_ca_file: {certs.ca_cert}\n  client_allowed_sans: [{san}]\n")))

    async def fetch(config: WebConfig) -> bytes | Exception:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"ok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=config.ssl_context())
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, server_hostname="localhost",
                ssl=client_context(certs, certs.client_cert, certs.client_key))
            try:
                return await asyncio.wait_for(reader.read(2), 10)
            except OSError as e:
                return e
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(fetch(config("spiffe://example.com/trainer"))) == b"ok"
    assert asyncio.run(fetch(config("ops@example.com"))) == b"ok"
    assert asyncio.run(fetch(config("'2001:db8::1'"))) == b"ok"  # Python prints it long
    assert asyncio.run(fetch(config("spiffe://example.com/someone-else"))) != b"ok"


def test_client_allowed_sans_are_enforced_by_a_plain_socket_server(
        tmp_path: Path, certs: TlsFiles) -> None:
    config = load(write(tmp_path, tls_yaml(
        certs, "  client_auth_type: RequireAndVerifyClientCert\n"
        f"  client_ca_file: {certs.ca_cert}\n  client_allowed_sans: [other.example.com]\n")))
    assert config.tls is not None
    assert config.tls.client_allowed_sans == frozenset({"other.example.com"})
    got, error = handshake(config.ssl_context(),
                           client_context(certs, certs.client_cert, certs.client_key))
    assert got != b"ok" and "client_allowed_sans" in str(error)


def test_inline_cert_and_key_work_like_files(tmp_path: Path, certs: TlsFiles) -> None:
    def block(path: Path) -> str:
        return "|\n" + "".join(f"    {line}\n" for line in path.read_text().splitlines())

    config = load(write(tmp_path, f"tls_server_config:\n  cert: {block(certs.server_cert)}"
                                  f"  key: {block(certs.server_key)}"))
    assert config.tls is not None and config.tls.cert_file is None
    assert handshake(config.ssl_context(), client_context(certs)) == (b"ok", None)


def test_relative_paths_are_resolved_against_the_config_files_directory(
        tmp_path: Path, certs: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    for name in ("server.crt", "server.key", "ca.crt"):
        (tmp_path / name).write_bytes((certs.server_cert.parent / name).read_bytes())
    path = write(tmp_path / "conf", "tls_server_config:\n  cert_file: ../server.crt\n"
                 "  key_file: ../server.key\n  client_ca_file: ../ca.crt\n"
                 "  client_auth_type: VerifyClientCertIfGiven\n")
    monkeypatch.chdir(certs.server_cert.parent.parent)  # anywhere but the config's directory
    config = load(path)
    assert config.tls is not None
    assert config.tls.cert_file == str(tmp_path / "conf" / ".." / "server.crt")
    assert config.tls.client_ca_file == str(tmp_path / "conf" / ".." / "ca.crt")
    assert handshake(config.ssl_context(), client_context(certs)) == (b"ok", None)


def test_a_minimum_tls_version_refuses_older_clients(tmp_path: Path, certs: TlsFiles) -> None:
    config = load(write(tmp_path, tls_yaml(certs, "  min_version: TLS13\n")))
    old = client_context(certs)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    got, error = handshake(config.ssl_context(), old)
    assert isinstance(got, ssl.SSLError) and isinstance(error, ssl.SSLError)


def test_missing_files_are_each_named_with_their_key(tmp_path: Path) -> None:
    path = write(tmp_path, "tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n")
    assert problems(path) == [
        f"{path}: tls_server_config.cert_file: cannot read {tmp_path}/nope.crt: "
        "No such file or directory",
        f"{path}: tls_server_config.key_file: cannot read {tmp_path}/nope.key: "
        "No such file or directory"]


def test_a_cert_without_a_key_and_a_key_that_does_not_match_are_problems(
        tmp_path: Path, certs: TlsFiles) -> None:
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {certs.server_cert}\n")
    assert problems(path) == [f"{path}: tls_server_config: missing one of key or key_file"]
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {certs.server_cert}\n"
                           f"  key_file: {certs.client_key}\n")
    assert problems(path) == [f"{path}: tls_server_config.key_file: {certs.client_key} "
                              f"does not match {certs.server_cert}"]


def test_bad_pem_is_named_without_printing_key_material(tmp_path: Path, certs: TlsFiles) -> None:
    (tmp_path / "bad.crt").write_text("not a certificate\n")
    secret = "-----BEGIN PRIVATE KEY-----\nc2VjcmV0IGtleSBtYXRlcmlhbA==\n-----END PRIVATE KEY-----"
    (tmp_path / "bad.key").write_text(secret)
    path = write(tmp_path, "tls_server_config:\n  cert_file: bad.crt\n"
                           f"  key_file: {certs.server_key}\n")
    assert problems(path) == [
        f"{path}: tls_server_config.cert_file: {tmp_path}/bad.crt holds no PEM certificate"]
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {certs.server_cert}\n"
                           "  key_file: bad.key\n")
    lines = problems(path)
    assert lines == [f"{path}: tls_server_config.key_file: {tmp_path}/bad.key "
                     "holds no PEM private key"]
    assert "c2VjcmV0" not in "\n".join(lines)


def test_an_encrypted_key_is_refused_without_prompting(tmp_path: Path, certs: TlsFiles) -> None:
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n"
                         "-----END ENCRYPTED PRIVATE KEY-----\n")
    path = write(tmp_path, tls_yaml(certs).replace(str(certs.server_key), str(encrypted)))
    assert problems(path) == [
        f"{path}: tls_server_config.key_file: {encrypted} is encrypted; give it unencrypted"]


def test_bad_yaml_is_one_problem_that_does_not_quote_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n  bob: [{HASH}\n")
    [line] = problems(path)
    assert line.startswith(f"{path}: not valid YAML: ") and "line 4" in line
    assert HASH not in line


def test_duplicate_keys_are_refused_as_exporter_toolkit_does(tmp_path: Path) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n  alice: {HASH}\n")
    [line] = problems(path)
    assert "duplicate key 'alice'" in line and "line 3" in line


def test_wrong_types_unknown_keys_and_bad_hashes_are_all_reported_together(
        tmp_path: Path, certs: TlsFiles) -> None:
    path = write(tmp_path, tls_yaml(certs, "  min_version: 12\n  max_version: TLS14\n"
                                           "  client_allowed_sans: example.com\n  cert_fil: x\n")
                 + "http_server_config:\n  http2: maybe\n  headers:\n    X-Frame-Options: allow\n"
                 "    Server: secret-server\n"
                 "basic_auth_users:\n  alice: $2y$10$tooshort\n  '': " + HASH + "\n"
                 "  bob: 12\n  'c:d': " + HASH + "\nlisten: 0.0.0.0\n")
    lines = problems(path)
    assert lines == [f"{path}: {line}" for line in (
        "listen: unknown key (known: tls_server_config, http_server_config, basic_auth_users, "
        "rate_limit)",
        "basic_auth_users.alice: not a bcrypt hash of cost 04-16 ($2y$, 60 characters; a higher "
        "cost "
        "makes each check take seconds)",
        "basic_auth_users.: a user name must be a non-empty string without ':'",
        "basic_auth_users.bob: not a bcrypt hash of cost 04-16 ($2y$, 60 characters; a higher "
        "cost "
        "makes each check take seconds)",
        "basic_auth_users.c:d: a user name must be a non-empty string without ':'",
        "http_server_config.headers.X-Frame-Options: must be one of deny, sameorigin",
        "http_server_config.headers.Server: this header cannot be set (only "
        "Strict-Transport-Security, X-Content-Type-Options, X-Frame-Options, X-XSS-Protection, "
        "Content-Security-Policy)",
        "http_server_config.http2: must be true or false",
        "tls_server_config.cert_fil: unknown key (known: cert, key, client_ca, cert_file, "
        "key_file, client_ca_file, client_auth_type, min_version, max_version, cipher_suites, "
        "curve_preferences, client_allowed_sans, prefer_server_cipher_suites)",
        "tls_server_config.min_version: must be a string",
        "tls_server_config.client_allowed_sans: must be a list of strings",
        "tls_server_config.max_version: unknown TLS version (one of TLS10, TLS11, TLS12, TLS13)",
    )]
    assert "$2y$10$tooshort" not in "\n".join(lines)


def test_client_auth_types_python_cannot_honour_are_refused_clearly(
        tmp_path: Path, certs: TlsFiles) -> None:
    for kind in ("RequestClientCert", "RequireAnyClientCert"):
        path = write(tmp_path, tls_yaml(certs, f"  client_auth_type: {kind}\n"
                                               f"  client_ca_file: {certs.ca_cert}\n"))
        assert problems(path) == [
            f"{path}: tls_server_config.client_auth_type: {kind} is not supported by "
            "dataloader-exporter (Python's ssl verifies any client certificate it asks for); "
            "use RequireAndVerifyClientCert"]
    path = write(tmp_path, tls_yaml(certs, "  client_auth_type: Whatever\n"))
    assert problems(path) == [f"{path}: tls_server_config.client_auth_type: unknown (one of "
                              "NoClientCert, VerifyClientCertIfGiven, RequireAndVerifyClientCert)"]


def test_a_client_ca_needs_a_verifying_auth_type_and_verifying_needs_a_ca(
        tmp_path: Path, certs: TlsFiles) -> None:
    path = write(tmp_path, tls_yaml(certs, f"  client_ca_file: {certs.ca_cert}\n"))
    assert problems(path) == [f"{path}: tls_server_config.client_ca_file: a client CA needs a "
                              "client_auth_type that verifies"]
    path = write(tmp_path, tls_yaml(certs, "  client_auth_type: RequireAndVerifyClientCert\n"
                                           "  client_allowed_sans: [a.example.com]\n"))
    assert problems(path) == [
        f"{path}: tls_server_config.client_ca_file: needed by RequireAndVerifyClientCert"]
    path = write(tmp_path, tls_yaml(certs, "  client_auth_type: VerifyClientCertIfGiven\n"
                                           f"  client_ca_file: {certs.ca_cert}\n"
                                           "  client_allowed_sans: [a.example.com]\n"))
    assert problems(path) == [f"{path}: tls_server_config.client_allowed_sans: needs "
                              "client_auth_type RequireAndVerifyClientCert"]


def test_settings_python_cannot_honour_are_refused_not_ignored(
        tmp_path: Path, certs: TlsFiles) -> None:
    path = write(tmp_path, tls_yaml(certs, "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n"
                                           "  curve_preferences: [X25519]\n"
                                           "  min_version: TLS13\n  max_version: TLS12\n")
                 + "rate_limit:\n  interval: 1s\n  burst: 20\n")
    assert problems(path) == [f"{path}: {line}" for line in (
        "rate_limit: not supported by dataloader-exporter (no rate limiter here)",
        "tls_server_config.cipher_suites: not supported by dataloader-exporter "
        "(OpenSSL's default suites apply)",
        "tls_server_config.curve_preferences: not supported by dataloader-exporter "
        "(Python's ssl has no curve preference list)",
        "tls_server_config.min_version: is above max_version")]
    config = load(write(tmp_path, tls_yaml(certs, "  cipher_suites: []\n"
                                                  "  prefer_server_cipher_suites: false\n")))
    assert not config.ssl_context().options & ssl.OP_CIPHER_SERVER_PREFERENCE  # type: ignore


def test_an_unreadable_config_file_is_one_problem(tmp_path: Path) -> None:
    path = str(tmp_path / "missing.yml")
    assert problems(path) == [f"{path}: cannot read the file: No such file or directory"]
    assert problems(write(tmp_path, "- a list\n"))[0].endswith("must hold a mapping of settings")


def test_authorized_accepts_the_right_password_only(tmp_path: Path) -> None:
    config = load(write(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n"))
    assert config.authorized(basic("alice", PASSWORD))
    assert config.authorized("basic " + basic("alice", PASSWORD)[6:])  # scheme is case-blind
    assert not config.authorized(basic("alice", b"wrong"))
    assert not config.authorized(basic("mallory", PASSWORD))
    for malformed in (None, "", "Basic", "Basic !!!", "Bearer abc", "Basic YWxpY2U=",
                      basic("alice", PASSWORD) + "=", "Basic " + "é"):
        assert not config.authorized(malformed), malformed


class CountingAuth(BasicAuth):
    """BasicAuth that counts its bcrypt checks."""

    calls = 0

    def checkpw(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return super().checkpw(password, hashed)


def test_a_right_password_is_cached_and_wrong_ones_or_unknown_users_cost_a_check() -> None:
    auth = CountingAuth({"alice": HASH.encode()})
    assert auth.check(basic("alice", PASSWORD)) and auth.calls == 1
    assert auth.check(basic("alice", PASSWORD)) and auth.calls == 1
    assert not auth.check(basic("alice", b"wrong")) and auth.calls == 2
    assert not auth.check(basic("alice", b"wrong")) and auth.calls == 3
    assert not auth.check(basic("mallory", PASSWORD)) and auth.calls == 4
    assert not auth.check("Basic !!!") and auth.calls == 4
    assert len(auth.cache) == 1


def test_the_cache_is_bounded_and_keeps_the_most_recent_users() -> None:
    users = {name: bcrypt.hashpw(name.encode(), bcrypt.gensalt(rounds=4)) for name in "abc"}
    auth = CountingAuth(users, cache_size=2)
    for name in "abca":
        assert auth.check(basic(name, name.encode()))
    assert [user for user, _ in auth.cache] == ["c", "a"] and auth.calls == 4


def test_authorized_is_safe_from_many_threads(tmp_path: Path) -> None:
    config = load(write(tmp_path, f"basic_auth_users:\n  alice: {HASH}\n"))
    headers = [basic("alice", PASSWORD), basic("alice", b"nope")] * 20
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(config.authorized, headers))
    assert results == [True, False] * 20


def test_a_header_value_that_is_not_printable_ascii_and_a_huge_bcrypt_cost_are_refused(
        tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    too_costly = hashed[:4] + "17" + hashed[6:]
    path = tmp_path / "web.yml"
    path.write_text("http_server_config:\n  headers:\n    Content-Security-Policy: \"a \u2014 b\"\n"
                    f"basic_auth_users:\n  alice: '{too_costly}'\n", encoding="utf-8")
    with pytest.raises(WebConfigError) as e:
        load(str(path))
    assert len(e.value.problems) == 2
    assert "cost 04-16" in e.value.problems[0] and "printable ASCII" in e.value.problems[1]
