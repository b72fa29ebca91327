"""HTTP/1.1 on the wire for the exporter's server: request heads in, response heads out.

Only what a metrics endpoint needs: a request line and headers (no body is ever read),
and response heads with a length. Everything it refuses is an early answer (Reply).
"""

from __future__ import annotations

from dataclasses import dataclass

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable", 505: "HTTP Version Not Supported"}
TEXT = "text/plain; charset=utf-8"


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    keep_alive: bool


class Reply(Exception):
    """An early answer to a request that cannot be served (bad request, timeout)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def parse_head(data: bytes) -> Request:
    """Request line and headers; Reply(400/505) when they are not HTTP/1.x."""
    lines = data.decode("latin-1").lstrip("\r\n").split("\r\n")  # RFC 9112 2.2: blank lines
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise Reply(400)
    method, target, version = parts
    if target.startswith(("http://", "https://")):  # the absolute form: keep the path
        target = "/" + target.split("://", 1)[1].partition("/")[2]
    if not target.startswith("/"):
        raise Reply(400)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise Reply(505 if version.startswith("HTTP/") else 400)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise Reply(400)
        headers[name.lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    # A request body is never read: answer, then close rather than parse it as a request.
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        keep = False
    return Request(method, target.split("?", 1)[0], version, headers, keep)


def accepts(header: str, token: str) -> bool:
    """Whether an Accept or Accept-Encoding value accepts `token` (a q=0 refuses it)."""
    for item in header.lower().split(","):
        name, *params = (p.strip() for p in item.split(";"))
        if name == token:
            return not any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000")
                           for p in params)
    return False


def response_head(status: int, ctype: str, length: int, request: Request | None,
                  keep_alive: bool, extra: str) -> bytes:
    """The status line and headers; Connection says what happens to the connection."""
    if not keep_alive:
        connection = "Connection: close\r\n"
    elif request is not None and request.version == "HTTP/1.0":
        connection = "Connection: keep-alive\r\n"
    else:
        connection = ""
    return (f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {length}\r\n{extra}{connection}\r\n").encode("latin-1")
