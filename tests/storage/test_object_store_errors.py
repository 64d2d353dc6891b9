"""`storage.objects.is_transient`: which object store failures a caller may retry later."""

from __future__ import annotations

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

from backfill.storage.objects import is_transient


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def test_unreachable_store_is_transient() -> None:
    s3 = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:1",
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2),
    )
    with pytest.raises(EndpointConnectionError) as down:
        s3.get_object(Bucket="b", Key="k")
    assert is_transient(down.value)
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))


def test_server_errors_and_throttling_are_transient_the_rest_is_not() -> None:
    assert is_transient(_client_error(503, "ServiceUnavailable"))
    assert is_transient(_client_error(500, "InternalError"))
    assert is_transient(_client_error(400, "SlowDown"))
    assert not is_transient(_client_error(404, "NoSuchKey"))
    assert not is_transient(_client_error(403, "AccessDenied"))
    assert not is_transient(NoCredentialsError())
    assert not is_transient(ValueError("not a store error"))
