"""Which webhook targets are refused (SSRF): every spelling of a non-public address, names that
resolve to one, the allow-list and development's loopback; and the pinned connection that
goes to the address the check approved, with the URL's own Host header."""

from __future__ import annotations

import http.server
import ipaddress
import socket
import threading
from collections.abc import Iterator

import pytest

from backfill.jobs.errors import InvalidRequest
from backfill.jobs.webhooks.targets import REFUSED, TargetPolicy, TargetRefused, check_url_target, literal_address
from backfill.scheduler.webhook_delivery import PinnedPoster
from backfill.storage.settings import Settings

PRODUCTION = TargetPolicy()


def no_dns(host: str, port: int) -> list[str]:
    raise AssertionError(f"{host} is an address literal: it must not be resolved")


REFUSED_HOSTS = [
    "127.0.0.1",
    "127.0.0.1.",  # trailing dot
    "2130706433",  # decimal
    "0x7f000001",  # hex
    "0x7F000001",  # uppercase
    "017700000001",  # octal
    "0177.0.0.1",  # octal dotted
    "127.1",  # short form
    "127.0.1",
    "0",  # unspecified
    "0.0.0.0",
    "[::]",
    "[::1]",
    "[::ffff:127.0.0.1]",  # IPv4-mapped
    "[::ffff:7f00:1]",
    "[::ffff:10.0.0.1]",
    "[2002:7f00:1::]",  # 6to4 around 127.0.0.1
    "[2002:a9fe:a9fe::]",  # 6to4 around 169.254.169.254
    "[64:ff9b::a00:1]",  # NAT64 around 10.0.0.1
    "[64:ff9b::127.0.0.1]",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",  # CGNAT
    "100.100.100.200",  # Alibaba's metadata
    "169.254.169.254",  # metadata (link-local)
    "0xa9fea9fe",
    "2852039166",  # 169.254.169.254 in decimal
    "[fd00:ec2::254]",  # AWS metadata over IPv6
    "[fe80::1]",
    "[fe80::1%25eth0]",
    "[fc00::1]",
    "[fec0::1]",  # site-local
    "224.0.0.1",  # multicast
    "[ff02::1]",
    "240.0.0.1",  # reserved
    "255.255.255.255",
    "198.18.0.1",  # benchmarking
    "localhost",
    "LOCALHOST.",
    "api.localhost",
    "metadata.google.internal",
    "Metadata.Google.Internal.",
    "metadata",
]


@pytest.mark.parametrize("host", REFUSED_HOSTS)
def test_non_public_hosts_are_refused_in_every_spelling(host: str) -> None:
    with pytest.raises(TargetRefused):
        PRODUCTION.check(host.replace("%25", "%"), 80, resolve=no_dns)


@pytest.mark.parametrize("host", ["8.8.8.8", "1.1.1.1", "[2606:4700:4700::1111]", "[2002:808:808::]", "134744072"])
def test_public_addresses_pass(host: str) -> None:
    assert PRODUCTION.check(host, 443, resolve=no_dns).is_global


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/hooks",
        "http://2130706433/",
        "http://0x7f000001:8080/",
        "http://127.1/",
        "http://[::ffff:127.0.0.1]/",
        "https://169.254.169.254/latest/meta-data/",
        "http://metadata.google.internal./computeMetadata/v1/",
        "http://LOCALHOST:5432/",
        "http://evil.example@127.0.0.1/",  # userinfo: refused as credentials before any host check
        "http://127.0.0.1\\@evil.example/",  # parsers disagree on the host: refused
    ],
)
def test_registration_refuses_non_public_urls(url: str) -> None:
    from backfill.jobs.webhooks.events import _check_url

    production = TargetPolicy.from_settings(Settings(environment="production", webhook_allowed_hosts=""))
    with pytest.raises(InvalidRequest) as refused:
        _check_url(url, production)
    assert refused.value.param == "url"


@pytest.mark.parametrize(
    "url", ["https://hooks.example.com:0/", "https://hooks.example.com:65536/", "http://8.8.8.8:99999/"]
)
def test_registration_refuses_ports_that_do_not_exist(url: str) -> None:
    from backfill.jobs.webhooks.events import _check_url

    with pytest.raises(InvalidRequest) as refused:
        _check_url(url, TargetPolicy.from_settings(Settings(environment="production", webhook_allowed_hosts="")))
    assert refused.value.param == "url"


def test_a_name_is_refused_if_any_address_it_resolves_to_is_private() -> None:
    def resolver(host: str, port: int) -> list[str]:
        return {"hooks.example": ["93.184.215.14", "10.1.2.3"], "ok.example": ["93.184.215.14"]}[host]

    with pytest.raises(TargetRefused):
        PRODUCTION.check("hooks.example", 443, resolve=resolver)
    assert PRODUCTION.check("OK.example.", 443, resolve=resolver) == ipaddress.ip_address("93.184.215.14")


def test_a_name_that_resolves_to_loopback_for_real_is_refused() -> None:
    # This machine's own host name: a name no rule knows, that the real resolver maps to an
    # address of this machine's (127.0.1.1 on Debian, the container's private address...).
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    except OSError:
        pytest.skip(f"{name} does not resolve here")
    if any(ipaddress.ip_address(a).is_global for a in addresses):
        pytest.skip(f"{name} resolves to a public address here: {addresses}")
    with pytest.raises(TargetRefused):
        PRODUCTION.check(name, 80)


def test_the_allow_list_and_development_open_what_they_name() -> None:
    allow = TargetPolicy.of(["10.20.0.0/16", "Hooks.Internal.", "[fd12::/16]"])
    assert allow.check("10.20.3.4", 80, resolve=no_dns) == ipaddress.ip_address("10.20.3.4")
    assert allow.check("[fd12::5]", 80, resolve=no_dns)
    assert allow.check("hooks.internal", 80, resolve=lambda h, p: ["10.9.9.9"])
    for host in ("10.21.0.1", "127.0.0.1", "169.254.169.254"):
        with pytest.raises(TargetRefused):
            allow.check(host, 80, resolve=no_dns)
    with pytest.raises(TargetRefused):  # an allowed name still never reaches the metadata service
        allow.check("hooks.internal", 80, resolve=lambda h, p: ["169.254.169.254"])

    development = TargetPolicy(allow_loopback=True)
    assert development.check("127.0.0.1", 80, resolve=no_dns).is_loopback
    assert development.check("[::1]", 80, resolve=no_dns).is_loopback
    assert development.check("localhost", 80, resolve=lambda h, p: ["127.0.0.1"]).is_loopback
    for host in ("10.0.0.1", "169.254.169.254", "192.168.0.1"):  # loopback only
        with pytest.raises(TargetRefused):
            development.check(host, 80, resolve=no_dns)


def test_settings_make_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill.storage.settings import Settings

    monkeypatch.setenv("BACKFILL_WEBHOOK_ALLOWED_HOSTS", "10.0.0.0/8, receiver.internal")
    monkeypatch.setenv("BACKFILL_ENVIRONMENT", "production")
    policy = TargetPolicy.from_settings(Settings())
    assert not policy.allow_loopback and policy.allowed_names == {"receiver.internal"}
    monkeypatch.setenv("BACKFILL_ENVIRONMENT", "development")
    assert TargetPolicy.from_settings(Settings()).allow_loopback


def test_literal_addresses_are_read_as_the_resolver_reads_them() -> None:
    assert literal_address("0x7f.1") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("[::1]") == ipaddress.ip_address("::1")
    assert literal_address("deadbeef.example") is None
    assert literal_address("cafe") is None  # hex letters without 0x: a name


@pytest.fixture
def host_echo() -> Iterator[tuple[int, list[str]]]:
    """A loopback HTTP server that records the Host header of each POST."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(self.headers.get("host", ""))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_connection_goes_to_the_checked_address_with_the_urls_host(host_echo: tuple[int, list[str]]) -> None:
    port, seen = host_echo
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])  # a rebinding resolver: the second answer differs

    def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    poster = PinnedPoster(TargetPolicy.of(["127.0.0.1/32"]), resolve=rebinding)
    url = f"http://hooks.example:{port}/in"
    assert poster.post(url, body=b"{}", headers={}) == 204
    assert seen == [f"hooks.example:{port}"]  # the name the team registered, sent to the checked address
    with pytest.raises(TargetRefused, match=REFUSED):  # the next delivery checks again
        poster.post(url, body=b"{}", headers={})
    assert len(seen) == 1


def test_check_url_target_accepts_names_that_do_not_resolve_yet() -> None:
    check_url_target("https://no-such-host.invalid/hooks", TargetPolicy())  # every delivery checks again
