"""--web.config.file end to end: a real Prometheus scrapes the sidecar over TLS with a
client certificate and basic auth; a wrong password gets 401; plain HTTP gets nothing.
The in-process server takes the same file."""

from __future__ import annotations

import base64
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry
from support.procs import Exporter, Prometheus, http_get
from support.required import require_binary
from support.tls import TlsFiles, make_tls_files

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat

pytestmark = pytest.mark.torch

PASSWORD = "s3cret-scrape"


def web_config(tmp_path: Path, tls: TlsFiles, client_ca: bool = True) -> Path:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    lines = ["tls_server_config:", f"  cert_file: {tls.server_cert}",
             f"  key_file: {tls.server_key}"]
    if client_ca:
        lines += ["  client_auth_type: RequireAndVerifyClientCert",
                  f"  client_ca_file: {tls.ca_cert}"]
    lines += ["basic_auth_users:", f"  prometheus: '{hashed}'"]
    path = tmp_path / "web.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def client_context(tls: TlsFiles, cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(tls.ca_cert))
    if cert:
        ctx.load_cert_chain(str(tls.client_cert), str(tls.client_key))
    return ctx


def fetch(url: str, ctx: ssl.SSLContext, password: str | None) -> tuple[int, str]:
    headers = {}
    if password is not None:
        token = base64.b64encode(f"prometheus:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return http_get(url, 10, ctx, headers)


def plain_http_answer(address: str) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        try:
            while chunk := s.recv(4096):
                data += chunk
        except ConnectionResetError:
            pass
    return data


@pytest.mark.slow
def test_prometheus_scrapes_over_tls_with_basic_auth_and_others_are_refused(
        tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    exp = Exporter("--no-collector.gpu", f"--web.config.file={web_config(tmp_path, tls)}")
    try:
        assert exp.url.startswith("https://")
        ctx = client_context(tls)
        status, body = fetch(exp.url + "/metrics", ctx, PASSWORD)
        assert status == 200 and cat.COLLECTOR_UP.name in body
        assert fetch(exp.url + "/metrics", ctx, "wrong")[0] == 401
        assert fetch(exp.url + "/metrics", ctx, None)[0] == 401
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            fetch(exp.url + "/metrics", client_context(tls, cert=False), PASSWORD)
        assert b"HTTP/1.1 200" not in plain_http_answer(exp.address)

        def job(name: str, password: str) -> dict[str, object]:
            return {"job_name": name, "scheme": "https",
                    "static_configs": [{"targets": [exp.address]}],
                    "tls_config": {"ca_file": str(tls.ca_cert), "cert_file": str(tls.client_cert),
                                   "key_file": str(tls.client_key)},
                    "basic_auth": {"username": "prometheus", "password": password}}

        prom = Prometheus(require_binary("prometheus"), tmp_path / "prometheus",
                          scrape_configs=[job("tls", PASSWORD), job("tls-wrong", "nope")])
        try:
            prom.wait_for(f'{cat.COLLECTOR_UP.name}{{job="tls",collector="host"}} == 1')
            prom.wait_for('up{job="tls-wrong"} == 0')
            assert prom.query('up{job="tls"}')[0]["value"][1] == "1"
            targets = prom.api("targets")["activeTargets"]
            wrong = [t for t in targets if t["labels"]["job"] == "tls-wrong"]
            assert "401" in wrong[0]["lastError"], wrong
        finally:
            prom.stop()
    finally:
        assert exp.stop() == 0
    assert not any(PASSWORD in line for line in exp.lines)


def test_a_bad_web_config_stops_the_sidecar_at_start_with_one_line_per_problem(
        tmp_path: Path) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config:\n  cert_file: /no/such.crt\n"
                   "basic_auth_users:\n  alice: not-a-bcrypt-hash\nbogus: 1\n")
    with pytest.raises(RuntimeError) as e:
        Exporter(f"--web.config.file={bad}")
    errors = [line for line in str(e.value).splitlines() if "error:" in line]
    assert len(errors) >= 3, errors  # the cert, the key it lacks or the hash, the bogus key
    assert all("--web.config.file" in line for line in errors)
    assert "not-a-bcrypt-hash" not in str(e.value)


def test_the_in_process_server_takes_the_same_web_config(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    registry = CollectorRegistry()
    loader = instrument.DataLoader(list(range(4)), batch_size=2, registry=registry)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    handle = instrument.serve(0, "127.0.0.1", registry=registry, system_metrics=False,
                              web_config_file=str(web_config(tmp_path, tls, client_ca=False)))
    try:
        assert handle.url.startswith("https://127.0.0.1:")
        ctx = client_context(tls, cert=False)
        status, body = fetch(handle.url + "/metrics", ctx, PASSWORD)
        assert status == 200 and cat.BATCHES.name in body
        assert fetch(handle.url + "/metrics", ctx, "wrong")[0] == 401
    finally:
        instrument.shutdown(registry)
    plain = instrument.serve(0, "127.0.0.1", registry=registry, system_metrics=False)
    try:  # the same address with a web config: never silently plain HTTP
        with pytest.raises(ValueError, match="another web config"):
            instrument.serve(plain.port, "127.0.0.1", registry=registry,
                             web_config_file=str(tmp_path / "web.yml"))
    finally:
        instrument.shutdown(registry)
    with pytest.raises(ValueError, match="no-such"):
        instrument.serve(0, "127.0.0.1", registry=CollectorRegistry(),
                         web_config_file=str(tmp_path / "no-such.yml"))


@pytest.mark.slow
def test_idle_connections_that_never_start_tls_cannot_starve_a_tls_scrape(
        tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    exp = Exporter("--no-collector.gpu", f"--web.config.file={web_config(tmp_path, tls)}",
                   max_files=256)
    held = []
    try:
        host, port = exp.address.rsplit(":", 1)
        for _ in range(300):  # more than the descriptors allow, none sends a ClientHello
            held.append(socket.create_connection((host, int(port)), timeout=10))
        status, _ = fetch(exp.url + "/metrics", client_context(tls), PASSWORD)
        assert status == 200
    finally:
        for s in held:
            s.close()
        assert exp.stop() == 0


@pytest.mark.slow
def test_wrong_passwords_queue_for_bcrypt_but_a_known_password_never_waits(
        tmp_path: Path) -> None:
    """bcrypt runs on its own thread, a few checks queued at most (429 beyond); a password
    that passed before is answered from the cache on the event loop."""
    import threading
    import time

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=13)).decode()
    start = time.perf_counter()
    bcrypt.checkpw(b"x", hashed.encode())
    one_check = time.perf_counter() - start
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    registry = CollectorRegistry()
    handle = instrument.serve(0, "127.0.0.1", registry=registry, system_metrics=False,
                              web_config_file=str(web))
    plain = ssl.create_default_context()  # unused over http, but fetch() takes one
    try:
        assert fetch(handle.url + "/-/healthy", plain, PASSWORD)[0] == 200  # now cached
        statuses: list[int] = []
        wrong = [threading.Thread(target=lambda: statuses.append(
            fetch(handle.url + "/-/healthy", plain, "wrong")[0])) for _ in range(8)]
        for t in wrong:
            t.start()
        time.sleep(0.05)  # let the wrong ones reach the server and queue
        begin = time.perf_counter()
        assert fetch(handle.url + "/-/healthy", plain, PASSWORD)[0] == 200
        assert time.perf_counter() - begin < one_check / 2
        for t in wrong:
            t.join()
        assert sorted(set(statuses)) == [401, 429], statuses
    finally:
        instrument.shutdown(registry)
