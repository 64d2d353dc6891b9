"""Webhook URLs whose host no parser can make sense of (an empty punycode label, an empty or
over-long label, a stray bracket, an IPv4 address in brackets) are a 400 at registration, in
OpenAI's envelope naming `url`, and a refused delivery, never a crash. And an allow-listed name
is still refused when it resolves to a metadata address however it is wrapped (IPv4-mapped,
NAT64 including the local-use 64:ff9b:1::/48)."""

from __future__ import annotations

import ipaddress

import pytest

from backfill.jobs.webhooks.events import DueDelivery, new_signing_secret
from backfill.jobs.webhooks.targets import REFUSED, TargetPolicy, TargetRefused
from backfill.scheduler.webhook_delivery import WebhookSender
from tests.api.conftest import CheckedClient, Team

BAD_URLS = [
    "http://xn--/",  # an A-label with nothing after the prefix: IDNAError
    "http://a..b/",  # an empty label: UnicodeError from the resolver's IDNA step
    "http://" + "a" * 64 + ".example.com/",  # a label over 63 characters
    "http://a]/",  # urlsplit: Invalid IPv6 URL
    "http://[1.2.3.4]/",  # urlsplit: an IPv4 address cannot be in brackets
    "http://xn--a.example.com/",  # punycode that does not decode
]


def no_dns(host: str, port: int) -> list[str]:
    raise AssertionError(f"{host!r} is not a host name: it must not be resolved")


@pytest.mark.parametrize("url", BAD_URLS)
def test_registration_answers_400_naming_the_url(api: CheckedClient, team: Team, url: str) -> None:
    body = {"name": "x", "url": url, "event_types": ["batch.completed"]}
    r = api.post("/v1/webhook_endpoints", headers=team.headers, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_url", "url")


@pytest.mark.parametrize("url", BAD_URLS)
def test_delivery_is_refused_without_a_crash(url: str) -> None:
    due = DueDelivery(delivery_id="d", attempt=1, url=url, msg_id="evt_1", body=b"{}", secrets=(new_signing_secret(),))
    for policy in (TargetPolicy(), TargetPolicy(allow_loopback=True)):
        status, error = WebhookSender(units=None, policy=policy, resolve=no_dns).send(due)  # type: ignore[arg-type]
        assert status is None and error in (REFUSED, "InvalidURL"), error


@pytest.mark.parametrize(
    "host", ["a..b", "a" * 64 + ".example.com", "xn--", "xn--a.example.com", "-a.example.com", "a b", "a/b"]
)
def test_the_policy_refuses_a_malformed_name_before_resolving_it(host: str) -> None:
    with pytest.raises(TargetRefused):
        TargetPolicy.of([host]).check(host, 443, resolve=no_dns)


@pytest.mark.parametrize(
    "resolved",
    [
        "::ffff:169.254.169.254",  # IPv4-mapped
        "::ffff:a9fe:a9fe",
        "64:ff9b::a9fe:a9fe",  # NAT64 (RFC 6052)
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215)
        "2002:a9fe:a9fe::1",  # 6to4
        "::ffff:100.100.100.200",
    ],
)
def test_an_allow_listed_name_is_refused_when_it_resolves_to_wrapped_metadata(resolved: str) -> None:
    policy = TargetPolicy.of(["hooks.internal.example"])
    with pytest.raises(TargetRefused):
        policy.check("hooks.internal.example", 443, resolve=lambda host, port: ["10.0.0.8", resolved])
    assert policy.check("hooks.internal.example", 443, resolve=lambda host, port: ["10.0.0.8"]) == (
        ipaddress.ip_address("10.0.0.8")
    )


def test_local_use_nat64_is_unwrapped() -> None:
    # An allow-listed network does not let the metadata address through inside 64:ff9b:1::/48,
    # and the IPv4 address inside is what a private-address check sees.
    with pytest.raises(TargetRefused):
        TargetPolicy.of(["64:ff9b:1::/48"]).check("[64:ff9b:1::a9fe:a9fe]", 80, resolve=no_dns)
    with pytest.raises(TargetRefused):
        TargetPolicy().check("[64:ff9b:1::a00:1]", 80, resolve=no_dns)  # 10.0.0.1 inside
    with pytest.raises(TargetRefused):
        TargetPolicy().check("[64:ff9b:1::7f00:1]", 80, resolve=no_dns)  # 127.0.0.1 inside
