"""The admin's ambient-credentials policy (`ferry.ambient`): who may use the platform's own S3 credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ferry.ambient import ENV, AmbientCredentialsDenied, AmbientPolicy
from ferry_agent.config import AgentConfig
from ferry_agent.ranks.supervisor import WorkerSettings
from ferry_agent.ranks.worker import RANK_CONFIG_ENV

pytestmark = pytest.mark.unit

DEFAULT = "http://s3.storage:8333"
INDEX = "model.safetensors.index.json"


def policy(*rules: dict) -> AmbientPolicy:
    return AmbientPolicy.parse(json.dumps(list(rules)))


def allowed(p: AmbientPolicy, namespace: str, uri: str, endpoint: str | None = None) -> bool:
    try:
        p.check(namespace, uri, endpoint, DEFAULT)
    except AmbientCredentialsDenied:
        return False
    return True


def test_no_rule_allows_nobody():
    for p in (AmbientPolicy(), AmbientPolicy.parse(""), AmbientPolicy.parse("[]"), AmbientPolicy.from_env({})):
        assert not allowed(p, "victim", f"s3://models/victim/v1/{INDEX}")


def test_the_denial_names_namespace_object_endpoint_and_the_chart_value():
    with pytest.raises(AmbientCredentialsDenied) as caught:
        AmbientPolicy().check("thief", f"s3://models/victim/v1/{INDEX}", "http://10.0.0.9:9000", DEFAULT)
    message = str(caught.value)
    for part in ("thief", f"s3://models/victim/v1/{INDEX}", "http://10.0.0.9:9000", "ambientCredentials", ENV):
        assert part in message, message
    assert "credentialsSecret" in message


def test_a_namespace_rule_covers_only_its_namespaces_and_prefixes():
    p = policy({"namespaces": ["victim"], "prefixes": ["s3://models/victim"]})
    assert allowed(p, "victim", f"s3://models/victim/v1/{INDEX}")
    assert not allowed(p, "thief", f"s3://models/victim/v1/{INDEX}")  # the cross-tenant read
    assert not allowed(p, "victim", f"s3://models/victim-b/v1/{INDEX}")  # whole segments only
    assert not allowed(p, "victim", f"s3://other/victim/v1/{INDEX}")
    assert not allowed(p, "victim", f"s3://models/victim/../thief/{INDEX}")  # servers that resolve `..`
    assert not allowed(p, "victim", f"s3://models/victim//x/{INDEX}")
    assert not allowed(p, "victim", "not-a-uri")


def test_namespace_placeholder_gives_each_namespace_its_own_folder():
    p = policy({"namespaces": ["*"], "prefixes": ["s3://models/{namespace}/"]})
    assert allowed(p, "victim", f"s3://models/victim/v1/{INDEX}")
    assert allowed(p, "thief", f"s3://models/thief/v1/{INDEX}")
    assert not allowed(p, "thief", f"s3://models/victim/v1/{INDEX}")
    assert not allowed(p, "thief", f"s3://models/{INDEX}")


def test_any_bucket_and_whole_bucket_prefixes():
    assert allowed(policy({"namespaces": ["*"], "prefixes": ["s3://*"]}), "a", f"s3://any-bucket/k/{INDEX}")
    whole = policy({"namespaces": ["a"], "prefixes": ["s3://models"]})
    assert allowed(whole, "a", f"s3://models/{INDEX}") and not allowed(whole, "a", f"s3://models2/{INDEX}")


def test_without_endpoints_a_rule_covers_only_the_default_endpoint():
    p = policy({"namespaces": ["a"], "prefixes": ["s3://models"]})
    uri = f"s3://models/a/{INDEX}"
    assert allowed(p, "a", uri) and allowed(p, "a", uri, DEFAULT + "/")  # named, but the default itself
    assert not allowed(p, "a", uri, "http://127.0.0.1:9999")  # a listener the tenant runs
    listed = policy({"namespaces": ["a"], "prefixes": ["s3://models"], "endpoints": ["HTTP://S3.other:9000/"]})
    assert allowed(listed, "a", uri, "http://s3.other:9000") and not allowed(listed, "a", uri)
    aws = policy({"namespaces": ["a"], "prefixes": ["s3://models"]})
    aws.check("a", uri, None, None)  # AWS's own endpoint is the default when none is configured
    with pytest.raises(AmbientCredentialsDenied):
        aws.check("a", uri, "http://127.0.0.1:9999", None)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ('{"namespaces": ["a"]}', "JSON list"),
        ('["a"]', "rule 0 is not an object"),
        ('[{"namespaces": ["a"], "prefixes": ["s3://b"], "bucket": "x"}]', "unknown keys ['bucket']"),
        ('[{"namespaces": [], "prefixes": ["s3://b"]}]', "namespaces must be a non-empty list"),
        ('[{"namespaces": ["a"]}]', "prefixes must be a non-empty list"),
        ('[{"namespaces": ["Team_A"], "prefixes": ["s3://b"]}]', "'Team_A' is not a namespace name"),
        ('[{"namespaces": ["a"], "prefixes": ["http://b"]}]', "is not an s3://bucket"),
        ('[{"namespaces": ["a"], "prefixes": ["s3://B!"]}]', "is not a bucket name"),
        ('[{"namespaces": ["a"], "prefixes": ["s3://models/x/../y"]}]', "invalid key prefix"),
        ('[{"namespaces": ["a"], "prefixes": ["s3://b"], "endpoints": ["s3.local"]}]', "not an http(s):// URL"),
    ],
)
def test_malformed_policies_say_what_is_wrong(text, says):
    with pytest.raises(ValueError) as caught:
        AmbientPolicy.parse(text)
    assert says in str(caught.value)


def test_a_malformed_policy_stops_the_operator_at_start():
    env = {**os.environ, ENV: '[{"namespaces": ["a"]}]'}
    proc = subprocess.run(
        [sys.executable, "-c", "import ferry_operator.config"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode != 0 and "prefixes must be a non-empty list" in proc.stderr, proc.stderr


def test_the_agent_reads_the_env_and_hands_the_same_rules_to_its_rank_processes(monkeypatch):
    text = json.dumps([{"namespaces": ["a"], "prefixes": ["s3://models/a"]}])
    monkeypatch.setenv(ENV, text)
    config = AgentConfig.from_args(["--node", "n1"])
    assert config.ambient_credentials == AmbientPolicy.parse(text)
    handed = WorkerSettings("n1-x", config).env()[RANK_CONFIG_ENV]
    assert AgentConfig.from_env(handed).ambient_credentials == AmbientPolicy.parse(text)
    assert AgentConfig.from_env(handed).ambient_credentials.text == text
    monkeypatch.delenv(ENV)
    assert AgentConfig.from_args(["--node", "n1"]).ambient_credentials == AmbientPolicy()
    with pytest.raises(SystemExit):
        AgentConfig.from_args(["--node", "n1", "--ambient-credentials", "[1]"])
