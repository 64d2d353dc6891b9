"""One HTTP POST to a webhook target, connected to the address its check let through.

The check (`jobs.webhook_targets`) resolves the host and approves every address; if the
connection then resolved the name again, a DNS answer that changed in between (rebinding) would
send the request somewhere never checked. So the connection goes to the approved address,
through an httpcore network backend that knows that one host and its one address, while the
request keeps its own Host header and, for https, its SNI and certificate check against the
host name. No redirect is followed (httpcore never follows one) and no proxy from the
environment is used.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Mapping

import httpcore
import httpx

from backfill.jobs.webhook_targets import Address, Resolver, TargetPolicy, system_resolver

# A receiver gets this long to answer; its body is never read (only the status counts).
TIMEOUTS = {"connect": 5.0, "read": 10.0, "write": 10.0, "pool": 10.0}
_DEFAULT_PORTS = {"http": 80, "https": 443}


class PinnedBackend(httpcore.NetworkBackend):
    """Connects `host` to `address` and refuses any other host."""

    def __init__(self, host: str, address: Address) -> None:
        self.host, self.address = host, address
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        if host != self.host:
            raise httpcore.ConnectError("refused: not the checked host")
        return self._inner.connect_tcp(str(self.address), port, timeout, local_address, socket_options)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("refused: no unix sockets")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class PinnedPoster:
    """POSTs to URLs whose host passes `policy`, each connection made to the checked address."""

    def __init__(
        self,
        policy: TargetPolicy,
        *,
        resolve: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "backfill",
    ) -> None:
        self.policy, self.resolve, self.user_agent = policy, resolve, user_agent
        self.ssl_context = ssl_context or httpx.create_ssl_context()

    def post(self, url: str, *, body: bytes, headers: Mapping[str, str]) -> int:
        """The status code of the answer (its body is never read). Raises TargetRefused for a
        host that is not allowed, OSError when it does not resolve, httpcore errors otherwise."""
        target = httpx.URL(url)
        host = target.raw_host.decode("ascii")
        port = target.port or _DEFAULT_PORTS[target.scheme]
        address = self.policy.check(host, port, resolve=self.resolve)
        request_headers = [
            ("host", target.netloc.decode("ascii")),
            ("user-agent", self.user_agent),
            ("content-length", str(len(body))),
            *headers.items(),
        ]
        with httpcore.ConnectionPool(
            ssl_context=self.ssl_context, network_backend=PinnedBackend(host, address), retries=0
        ) as pool:
            with pool.stream(
                "POST",
                httpcore.URL(scheme=target.scheme, host=host, port=port, target=target.raw_path),
                headers=request_headers,
                content=body,
                extensions={"timeout": TIMEOUTS},
            ) as response:
                return response.status
