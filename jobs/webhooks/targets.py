"""Where a webhook may be sent: public addresses only (no SSRF into the service's own network).

A team chooses the URL its events are POSTed to, and the delivery log shows what came back;
without this check a team could aim deliveries at Postgres, Redis, the object store, the fleet
or a cloud metadata service and read the answers' status codes and errors. So in production a
target must be, and resolve only to, globally routable unicast addresses. Every spelling of an
address is read the way the resolver would read it (decimal `2130706433`, hex `0x7f000001`,
octal, short `127.1`, IPv4-mapped, 6to4 and NAT64 IPv6), and a name is resolved and every
address it resolves to is checked.

Exceptions: the operator's allow-list (`BACKFILL_WEBHOOK_ALLOWED_HOSTS`: host names, addresses
or CIDRs, for internal receivers) and, outside production, loopback (local development).
Cloud metadata services are refused even then.

The check runs at registration and again at every delivery; the sender then connects to the
very address that passed (`scheduler.webhook_delivery`), so DNS cannot answer differently between
the check and the connection.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from backfill.jobs.errors import InvalidRequest
from backfill.storage.settings import Settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses it resolves to, as text; raises OSError when it does not resolve.
Resolver = Callable[[str, int], list[str]]

REFUSED = "refused: address not allowed"
METADATA_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.azure.com",
    }
)
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "169.254.169.123", "fd00:ec2::254", "100.100.100.200")
)
# NAT64 prefixes (RFC 6052's well-known one and RFC 8215's local-use range); the IPv4 address
# rides in the last 32 bits, as with the /96 prefixes translators use in practice.
NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
# A DNS host name as resolvers accept it: labels of 1-63 letters, digits, hyphens (not at either
# end) and underscores (some internal names carry them), 253 characters in all.
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
MAX_NAME_CHARS = 253
# Characters of the legacy IPv4 spellings inet_aton reads (decimal, octal, hex, short forms).
_LEGACY_IPV4_CHARS = frozenset("0123456789abcdefx.")


class TargetRefused(Exception):
    """The host is, or resolves to, an address webhooks may not be sent to."""


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def normal_host(host: str) -> str:
    """Lowercase, without brackets or the trailing dot of a fully qualified name."""
    return host.strip().strip("[]").lower().rstrip(".")


def valid_name(name: str) -> bool:
    """Whether `name` (normalized, ASCII) is a host name a resolver can look up: each label
    well formed, and an `xn--` label real punycode. Anything else (an empty or over-long label,
    a bracket, `xn--` with nothing after it) is refused before any lookup: the resolver's own
    IDNA step raises UnicodeError on some, and none can name a receiver."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isascii():
        return False
    for label in name.split("."):
        if not _LABEL.fullmatch(label):
            return False
        if label.startswith("xn--"):
            try:
                label.encode("ascii").decode("idna")
            except UnicodeError:
                return False
    return True


def literal_address(host: str) -> Address | None:
    """The address a host written as an IP literal stands for, in any spelling the system
    resolver accepts; None for a name."""
    text = normal_host(host)
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if text and set(text) <= _LEGACY_IPV4_CHARS:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def _carried(address: Address) -> list[Address]:
    """The address as it will be reached: an IPv4-mapped IPv6 address is its IPv4 one, and one
    that embeds an IPv4 address (6to4, NAT64) is checked as both."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return [address.ipv4_mapped]
        if address.sixtofour is not None:
            return [address, address.sixtofour]
        if any(address in prefix for prefix in NAT64):
            return [address, ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    return [address]


def _metadata(addresses: Iterable[Address]) -> bool:
    """Whether any address is, or carries, a cloud metadata service's."""
    return any(a in METADATA_ADDRESSES for address in addresses for a in _carried(address))


def _public(a: Address) -> bool:
    site_local = isinstance(a, ipaddress.IPv6Address) and a.is_site_local
    return a.is_global and not (
        a.is_multicast or a.is_reserved or a.is_link_local or a.is_loopback or a.is_unspecified or site_local
    )


@dataclass(frozen=True)
class TargetPolicy:
    allow_loopback: bool = False
    allowed_names: frozenset[str] = frozenset()
    allowed_networks: tuple[Network, ...] = field(default_factory=tuple)

    @classmethod
    def from_settings(cls, s: Settings) -> TargetPolicy:
        return cls.of(s.webhook_allowed_hosts, allow_loopback=s.environment != "production")

    @classmethod
    def of(cls, entries: Iterable[str], *, allow_loopback: bool = False) -> TargetPolicy:
        names, networks = set(), []
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                names.add(normal_host(entry))
        return cls(allow_loopback=allow_loopback, allowed_names=frozenset(names), allowed_networks=tuple(networks))

    def address_allowed(self, address: Address) -> bool:
        carried = _carried(address)
        if _metadata(carried):
            return False
        return all(
            _public(a)
            or any(a.version == n.version and a in n for n in self.allowed_networks)
            or (self.allow_loopback and a.is_loopback)
            for a in carried
        )

    def check(self, host: str, port: int, *, resolve: Resolver = system_resolver) -> Address:
        """The address to connect to for `host`, once it and every address it resolves to
        passed; raises TargetRefused (or OSError when a name does not resolve)."""
        name = normal_host(host)
        if name in METADATA_NAMES:
            raise TargetRefused(REFUSED)
        literal = literal_address(name)
        if literal is not None:
            addresses = [literal]
        else:
            if not valid_name(name):
                raise TargetRefused(REFUSED)
            named = name in self.allowed_names
            if (name == "localhost" or name.endswith(".localhost")) and not (named or self.allow_loopback):
                raise TargetRefused(REFUSED)
            try:
                resolved = resolve(name, port)
            except UnicodeError:  # the resolver's IDNA step: no name it could look up
                raise TargetRefused(REFUSED) from None
            addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in resolved]
            if named:  # the operator vouched for this name: whatever it resolves to, bar metadata
                if not addresses or _metadata(addresses):
                    raise TargetRefused(REFUSED)
                return addresses[0]
        if not addresses or not all(self.address_allowed(a) for a in addresses):
            raise TargetRefused(REFUSED)
        return addresses[0]


def invalid_url() -> InvalidRequest:
    return InvalidRequest("'url' is not a valid URL.", param="url", code="invalid_url")


def check_url_target(url: str, policy: TargetPolicy) -> None:
    """Refuse a host that is or resolves to a non-public address (see jobs.webhooks.targets); a
    name that does not resolve yet is accepted, as every delivery checks again."""
    try:
        target = httpx.URL(url)
        # Port 0 is no port, and past 65535 none exists (httpx takes both; a connection cannot).
        if target.port is not None and not 0 < target.port <= 65535:
            raise invalid_url()
        port = target.port or (443 if target.scheme == "https" else 80)
        host = target.raw_host.decode("ascii")
        # Decoding IDNA (`target.host`) and urlsplit's bracket rules raise ValueError too.
        hosts_agree = normal_host(target.host) == normal_host(urlsplit(url).hostname or "")
    except (httpx.InvalidURL, ValueError):  # UnicodeError and IDNAError are ValueErrors
        raise invalid_url() from None
    # A backslash or a host two parsers read differently is a trick, never a receiver.
    if "\\" in url or not hosts_agree or (literal_address(host) is None and not valid_name(normal_host(host))):
        raise invalid_url()
    try:
        policy.check(host, port)
    except TargetRefused:
        raise InvalidRequest(
            "'url' must point to a public address: this host is, or resolves to, a private, loopback, "
            "link-local or metadata address.",
            param="url",
            code="webhook_url_not_allowed",
        ) from None
    except OSError:
        pass
