"""`ferry.s3`: URI parsing, credentials from a Secret, client profiles and their one cache, and the translation of
every class of botocore error into Ferry's error classes."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProxyConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from ferry import s3
from ferry.errors import Conflict, FerryError, InvalidInput, NotFound, Transient
from ferry.s3 import credentials_from_secret_data, parse_s3_uri

pytestmark = pytest.mark.unit

WHAT = "shard s3://weights/llama/v1/model-00001-of-00002.safetensors"


def client_error(code: str, status: int, message: str = "") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


# ---------------------------------------------------------------- the error translator


@pytest.mark.parametrize(
    ("error", "cls", "category"),
    [
        # S3 answered with an error: classified by its code, else by its HTTP status.
        (client_error("NoSuchKey", 404, "The specified key does not exist."), s3.ObjectMissing, NotFound),
        (client_error("NoSuchBucket", 404), s3.ObjectMissing, NotFound),
        (client_error("404", 404), s3.ObjectMissing, NotFound),  # a HEAD has no body, so no code
        (client_error("", 404), s3.ObjectMissing, NotFound),
        (client_error("AccessDenied", 403), s3.AccessDenied, InvalidInput),
        (client_error("403", 403), s3.AccessDenied, InvalidInput),
        (client_error("InvalidAccessKeyId", 403), s3.AccessDenied, InvalidInput),
        (client_error("SignatureDoesNotMatch", 403), s3.AccessDenied, InvalidInput),
        (client_error("AllAccessDisabled", 403), s3.AccessDenied, InvalidInput),
        (client_error("PreconditionFailed", 412), s3.PreconditionFailed, Conflict),
        (client_error("ConditionalRequestConflict", 409), s3.PreconditionFailed, Conflict),
        (client_error("InternalError", 500), s3.Unreachable, Transient),
        (client_error("SlowDown", 503), s3.Unreachable, Transient),
        (client_error("SomethingNew", 400), s3.Unreachable, Transient),
        # No usable credentials.
        (NoCredentialsError(), s3.CredentialsMissing, InvalidInput),
        (
            PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
            s3.CredentialsMissing,
            InvalidInput,
        ),
        # The endpoint could not be reached, or the connection broke.
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), s3.Unreachable, Transient),
        (ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), s3.Unreachable, Transient),
        (ProxyConnectionError(proxy_url="http://proxy:3128"), s3.Unreachable, Transient),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), s3.Unreachable, Transient),
        (ResponseStreamingError(error="connection reset"), s3.Unreachable, Transient),
        # Any other botocore failure: the object may be fine.
        (ParamValidationError(report="Bucket is required"), s3.Unreachable, Transient),
    ],
)
def test_translate(error: Exception, cls: type[FerryError], category: type[FerryError]) -> None:
    translated = s3.translate(error, WHAT)
    assert type(translated) is cls and isinstance(translated, category)
    message = str(translated)
    assert WHAT in message and not message.endswith(".")


def test_translated_messages_say_what_happened() -> None:
    missing = str(s3.translate(client_error("NoSuchKey", 404, "The specified key does not exist."), WHAT))
    assert missing == f"{WHAT} does not exist (NoSuchKey: The specified key does not exist)"
    denied = str(s3.translate(client_error("", 403), WHAT))
    assert denied == f"access to {WHAT} was denied (403: no message); check the credentials"
    assert "Could not connect" in str(s3.translate(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), WHAT))


def test_the_categories_are_disjoint_where_callers_branch() -> None:
    """A miss is never transient nor bad input, so a load tries its next source only on a real miss."""
    for cls in (s3.ObjectMissing, s3.AccessDenied, s3.CredentialsMissing, s3.Unreachable, s3.PreconditionFailed):
        kinds = [k for k in (NotFound, Transient, InvalidInput, Conflict) if issubclass(cls, k)]
        assert len(kinds) == 1, (cls, kinds)


def test_error_code() -> None:
    assert s3.error_code(client_error("InvalidRange", 416)) == "InvalidRange"
    assert s3.error_code(client_error("", 404)) == "404"
    assert s3.error_code(ValueError("x")) == ""


# ---------------------------------------------------------------- URIs


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/model.safetensors.index.json", ("bucket", "model.safetensors.index.json")),
        ("s3://my.bucket-1/a/b/c/index.json", ("my.bucket-1", "a/b/c/index.json")),
    ],
)
def test_parse_s3_uri(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "http://bucket/key",
        "s3://",
        "s3://bucket",
        "s3://bucket/",
        "s3://bucket/dir/",
        "s3://Bucket/key",
        "s3://b/key",
        "s3:///key",
        "s3://bucket\n/key",
        "s3://bucket/has space",
        "s3://bucket/a/../model.safetensors.index.json",
        "s3://bucket/../model.safetensors.index.json",
        "s3://bucket/./model.safetensors.index.json",
        "s3://bucket/a//model.safetensors.index.json",
        "s3://bucket/a/..",
        None,
    ],
)
def test_parse_s3_uri_rejects(uri: Any) -> None:
    with pytest.raises(ValueError):
        parse_s3_uri(uri)


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("s3://bucket", ("bucket", "")),
        ("s3://bucket/", ("bucket", "")),
        ("s3://my.bucket-1/models/llama", ("my.bucket-1", "models/llama/")),
        ("s3://bucket/models/llama/", ("bucket", "models/llama/")),
    ],
)
def test_parse_s3_prefix(prefix: str, expected: tuple[str, str]) -> None:
    assert s3.parse_s3_prefix(prefix) == expected


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        ("bucket/models", "is not an s3://bucket/prefix URI"),
        ("s3://Bucket/models", "'Bucket' is not a valid bucket name"),
        ("s3://b", "'b' is not a valid bucket name"),
        ("s3://bucket/a/../b", "invalid key prefix"),
        ("s3://bucket/a//b", "invalid key prefix"),
        ("s3://bucket/a b", "invalid key prefix"),
    ],
)
def test_parse_s3_prefix_rejects(prefix: str, match: str) -> None:
    with pytest.raises(s3.InvalidUri, match=match) as exc:
        s3.parse_s3_prefix(prefix)
    assert isinstance(exc.value, InvalidInput) and isinstance(exc.value, ValueError)


# ---------------------------------------------------------------- profiles and the cache


def test_publishing_uses_path_style_only_with_an_endpoint() -> None:
    assert s3.new_client("http://127.0.0.1:9", "us-east-1", None, s3.publishing()).meta.config.s3 == {
        "addressing_style": "path"
    }
    assert not s3.new_client(None, "us-east-1", None, s3.publishing()).meta.config.s3
    config = s3.new_client(None, "us-east-1", None, s3.publishing()).meta.config
    assert config.retries["total_max_attempts"] == 5 and config.max_pool_connections == 32


def test_verification_pool_size() -> None:
    config = s3.new_client("http://127.0.0.1:9", None, None, s3.verification(pool=48)).meta.config
    assert config.max_pool_connections == 48


def test_one_cached_client_per_settings() -> None:
    s3.forget_clients()
    creds = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    first = s3.client("http://127.0.0.1:9", None, creds, s3.verification())
    assert s3.client("http://127.0.0.1:9", None, dict(creds), s3.verification()) is first
    assert s3.client("http://127.0.0.1:9", None, creds, s3.bulk_download(8, 30)) is not first
    assert (
        s3.client("http://127.0.0.1:9", None, {**creds, "AWS_SECRET_ACCESS_KEY": "t"}, s3.verification()) is not first
    )
    s3.forget_clients()
    assert s3.client("http://127.0.0.1:9", None, creds, s3.verification()) is not first


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    s3.forget_clients()
    monkeypatch.setattr(s3, "MAX_CLIENTS", 2)
    oldest = s3.client("http://127.0.0.1:1", None, None, s3.verification())
    s3.client("http://127.0.0.1:2", None, None, s3.verification())
    s3.client("http://127.0.0.1:3", None, None, s3.verification())
    assert len(s3._clients) == 2
    assert s3.client("http://127.0.0.1:1", None, None, s3.verification()) is not oldest
    s3.forget_clients()


# ---------------------------------------------------------------- credentials and clients


def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def test_credentials_from_secret_data() -> None:
    data = {"AWS_ACCESS_KEY_ID": b64("AKIA"), "AWS_SECRET_ACCESS_KEY": b64("s3cr3t\n"), "other": b64("x")}
    assert credentials_from_secret_data(data) == {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    data["AWS_SESSION_TOKEN"] = b64("tok")
    assert credentials_from_secret_data(data)["AWS_SESSION_TOKEN"] == "tok"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({}, "AWS_ACCESS_KEY_ID"),
        (None, "AWS_ACCESS_KEY_ID"),
        ({"AWS_ACCESS_KEY_ID": b64("a")}, "no key AWS_SECRET_ACCESS_KEY"),
        ({"AWS_ACCESS_KEY_ID": "***", "AWS_SECRET_ACCESS_KEY": b64("s")}, "AWS_ACCESS_KEY_ID is not valid base64"),
        ({"AWS_ACCESS_KEY_ID": b64("a"), "AWS_SECRET_ACCESS_KEY": ""}, "AWS_SECRET_ACCESS_KEY is empty"),
    ],
)
def test_credentials_from_secret_data_names_the_bad_key(data: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        credentials_from_secret_data(data)


def test_s3_client_configuration() -> None:
    creds = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    client = s3.new_client("http://127.0.0.1:9", "eu-west-1", creds, s3.verification())
    config = client.meta.config
    assert client.meta.endpoint_url == "http://127.0.0.1:9" and client.meta.region_name == "eu-west-1"
    assert config.s3 == {"addressing_style": "path"}
    assert config.connect_timeout <= 5 and config.read_timeout <= 30
    assert config.retries["total_max_attempts"] <= 3
    credentials = client._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == ("k", "s")


def test_s3_client_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    credentials = s3.new_client(None, "us-east-1", None, s3.verification())._request_signer._credentials
    assert (credentials.access_key, credentials.secret_key) == ("env-key", "env-secret")


@pytest.mark.parametrize("timeout_s", [1, 9, 30, 300, 86400])
def test_every_try_of_an_agent_s3_request_fits_in_the_transfer_timeout(timeout_s: int) -> None:
    connect, read = s3.request_timeouts(timeout_s)
    assert 0 < connect <= 5 and 0 < read <= 60 and s3.BULK_ATTEMPTS * (connect + read) <= timeout_s + 1e-9
    config = s3.new_client("http://127.0.0.1:1", None, None, s3.bulk_download(4, timeout_s)).meta.config
    assert (config.connect_timeout, config.read_timeout) == (connect, read)
    assert config.retries["total_max_attempts"] == s3.BULK_ATTEMPTS


def _retry_delay(profile: s3.ClientProfile, attempt: int, **kwargs: Any) -> float | None:
    """What Ferry's retry handler answers for try `attempt` of a GetObject that failed as `kwargs` say."""
    from botocore.awsrequest import AWSResponse

    status = kwargs.pop("status", None)
    code = kwargs.pop("code", None)
    response = None
    if status is not None:
        parsed = {"Error": {"Code": code}} if code else {}
        response = (AWSResponse("http://s3", status, {}, None), parsed)
    return s3.Retries(profile)(
        attempts=attempt,
        response=response,
        caught_exception=kwargs.pop("exception", None),
        operation=None,
        request_dict={"context": {}},
    )


def test_throttling_is_retried_more_often_than_a_timeout_with_growing_jittered_backoff() -> None:
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    profile = s3.bulk_download(4, 300)
    for throttled in (
        {"status": 503, "code": "SlowDown"},
        {"status": 503},
        {"status": 429},
        {"status": 400, "code": "SlowDown"},
    ):
        delays = [_retry_delay(profile, n, **throttled) for n in range(1, s3.THROTTLED_ATTEMPTS)]
        assert all(
            d is not None and 0 <= d <= min(s3.THROTTLE_BACKOFF_S * 2 ** (n - 1), s3.MAX_BACKOFF_S)
            for n, d in enumerate(delays, 1)
        )
        assert _retry_delay(profile, s3.THROTTLED_ATTEMPTS, **throttled) is None
    for timeout in (ReadTimeoutError(endpoint_url="http://s3"), ConnectTimeoutError(endpoint_url="http://s3")):
        assert _retry_delay(profile, s3.TIMEOUT_ATTEMPTS - 1, exception=timeout) is not None
        assert _retry_delay(profile, s3.TIMEOUT_ATTEMPTS, exception=timeout) is None
    dropped = EndpointConnectionError(endpoint_url="http://s3")
    for transient in ({"exception": dropped}, {"status": 500, "code": "InternalError"}, {"status": 502}):
        assert _retry_delay(profile, s3.BULK_ATTEMPTS - 1, **transient) is not None
        assert _retry_delay(profile, s3.BULK_ATTEMPTS, **transient) is None
    for final in ({"status": 404, "code": "NoSuchKey"}, {"status": 403, "code": "AccessDenied"}):
        assert _retry_delay(profile, 1, **final) is None


def test_a_hung_endpoint_fails_an_agent_request_well_within_a_minute_by_default() -> None:
    from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S

    profile = s3.bulk_download(8, DEFAULT_TRANSFER_TIMEOUT_S)
    assert profile.connect_timeout <= 5 and profile.read_timeout <= 20
    assert profile.timeout_attempts * (profile.connect_timeout + profile.read_timeout) <= 45
