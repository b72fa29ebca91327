"""The serve command's value parsers: text from a flag or an environment variable -> a
value. A parser raises ValueError with the reason (exporter.config names the flag and the
text), or Problems with whole lines where it names them itself."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import re

from dataloader_exporter.core.problems import Problems
from dataloader_exporter.core.settings import log_name, parse_bool

__all__ = ["parse_address", "parse_bool", "parse_count", "parse_seconds"]

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)?")  # ASCII: float() reads '\u0663'
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0,
         None: 1.0}
_MAX_DIGITS = 18  # a count or a duration longer than this is a typo (and int() of 100 kB is slow)


def parse_seconds(text: str) -> float:
    """'30', '30s', '1.5m', '500ms', '7d', '1w' -> seconds (positive, finite); ValueError
    otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if m is not None and len(m.group(1)) <= _MAX_DIGITS:
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
        if 0 < seconds < math.inf:
            return seconds
    raise ValueError("must be a positive duration (30, 30s, 2m)")


def parse_count(text: str) -> int:
    """ASCII digits of a positive whole number -> the number; ValueError otherwise."""
    digits = text.strip()
    if digits.isascii() and digits.isdecimal() and len(digits) <= _MAX_DIGITS and int(
            digits) > 0:
        return int(digits)
    raise ValueError("must be a positive whole number")


_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")  # a DNS label (RFC 1035), '_' as /etc/hosts allows
_MAX_NAME = 253  # a DNS name's longest text form: 255 octets on the wire (RFC 1035 2.3.4)


def _host_problem(host: str, bracketed: bool) -> str | None:
    """Why a listen host cannot be an address or a host name; None when it can.

    Checked here so that the resolver (whose IDNA codec raises UnicodeError for a label
    over 63 characters) only ever sees names it can look up; whether the name resolves is
    the bind's to say.
    """
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "brackets hold an IPv6 address only"
        return None
    if not host.isascii():
        return "the host must be ASCII (write an internationalized name in its xn-- form)"
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(host)
        return None
    name = host.removesuffix(".")
    if len(name) > _MAX_NAME:
        return f"the host name is {len(name)} characters, over {_MAX_NAME}"
    for label in name.split("."):
        if len(label) > 63:
            return f"the host label {log_name(label)!r} is longer than 63 characters"
        if not _LABEL.fullmatch(label):
            return (f"bad host {log_name(host)!r}: each dot-separated label is 1 to 63 "
                    "letters, digits, '-' or '_'")
    return None


def parse_address(text: str) -> tuple[str, int]:
    """'[HOST]:PORT' (IPv6 in brackets) -> (host, port); raises Problems (a ValueError) with
    the whole line when bad.

    An empty host is every IPv4 interface; '[::]' every IPv6 one."""
    text = text.strip()
    shown = repr(log_name(text))
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise Problems(f"listen address {shown} is not [HOST]:PORT")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    elif ":" in host:
        raise Problems(f"listen address {shown}: put an IPv6 host in brackets")
    if not (port_text.isascii() and port_text.isdecimal()) or len(port_text) > 5 or not (
            0 <= int(port_text) <= 65535):
        raise Problems(f"listen address {shown}: port must be 0-65535")
    problem = _host_problem(host, bracketed) if host or bracketed else None
    if problem is not None:
        raise Problems(f"listen address {shown}: {problem}")
    return host or "0.0.0.0", int(port_text)
