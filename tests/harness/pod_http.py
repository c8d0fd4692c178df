"""HTTP between the host and a pod: the shell line that makes a busybox
httpd in a container serve a page, and the GET the tests and benchmarks
send it over a plain TCP connection."""

from __future__ import annotations

import socket

from tests.harness.daemons import wait_until


def serve(text: str, port: int = 80) -> str:
    """busybox httpd in the foreground, serving text at /."""
    return f"mkdir -p /www && echo {text} > /www/index.html && exec httpd -f -p {port} -h /www"


def http_get(address: str, port: int, timeout: float = 5.0, sock: socket.socket | None = None) -> bytes:
    """GET / over HTTP/1.0; the body."""
    if sock is None:
        sock = socket.create_connection((address, port), timeout=timeout)
    with sock:
        sock.settimeout(timeout)
        sock.sendall(f"GET / HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), answer[:200]
    return body


def eventually_get(address: str, port: int, expected: bytes, what: str, get=http_get) -> None:
    """Until get answers expected, within a minute; a timeout names what and the last answer or error."""
    seen: list[str] = []

    def answered() -> bool:
        try:
            body = get(address, port)
        except OSError as exc:
            seen[-1:] = [f"{type(exc).__name__}: {exc}"]
            return False
        seen[-1:] = [repr(body)]
        return body == expected

    wait_until(answered, timeout=60, what=f"{what}; last: {seen}")
