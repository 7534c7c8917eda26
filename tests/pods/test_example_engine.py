"""examples/vllm-engine as users install it, on two real kubelet nodes next to the ferry chart, with a small
transformers engine (`python -m ferry_dev.example_engine`, from the agent's dev image) in place of vLLM, which
needs a GPU. Only one node is an agent node (`ferry.dev/gpu=true`): the engine pod must land there. It is not Ready
while its node has nothing to serve (the startup probe sees /health 503); once the trainer publishes the version the
chart's ModelLoad names, the weights follow the pod onto its node, the engine attaches and loads them, the pod
becomes Ready, the ModelLoad shows it attached, the node carries the warm label the pod's affinity prefers, and a
completion through the apiserver's pod proxy returns the tokens the trainer's own copy of the weights generates.
Then both nodes are agent nodes and the ModelLoad keeps a warm pool of one: a replacement engine pod goes to the warm
node (without the preferred affinity the scheduler picks the other one here). The tests run in order."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file

from ferry_dev import localimages
from ferry_dev.demo_engine import build_model, generate
from tests.support.helm import vendored_example
from tests.support.objects import condition
from tests.support.pods import (
    FERRY_CHART,
    create_tenant,
    describe,
    ferry_publish,
    ferry_values,
    helm,
    kubectl,
    pods,
    ready,
    wait_for,
)

pytestmark = pytest.mark.pods

NS = "ferry-system"
TENANT = "team-e"
RELEASE = "ferry"
ENGINE = "engine"
ENGINE_PODS = f"app.kubernetes.io/instance={ENGINE}"
MODEL_LOAD = "llama"
MODEL = "tiny-llama"
VERSION = "tiny-llama-v1"
BUCKET = "example-models"
AGENT_LABEL = "ferry.dev/gpu"
CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
PROMPT, STEPS = [3, 141, 59, 26, 5], 8


def explain(stack) -> str:
    return f"{describe(stack, TENANT, ENGINE_PODS)}\n{describe(stack, NS, f'app.kubernetes.io/instance={RELEASE}')}"


@pytest.fixture(scope="module")
def agent_node(pod_stack, tmp_path_factory) -> str:
    """The ferry chart installed, its agent on the one node still labelled an agent node; that node's name."""
    stack = pod_stack
    create_tenant(stack, TENANT, NS)
    plain, agent = stack.nodes.nodes
    kubectl(stack, "label", "node", plain.name, f"{AGENT_LABEL}-")
    values = ferry_values(tmp_path_factory.mktemp("values"), TENANT)
    helm(stack, "install", RELEASE, str(FERRY_CHART), "-n", NS, "-f", str(values), "--take-ownership")

    def up() -> bool:
        everything = pods(stack, NS, f"app.kubernetes.io/instance={RELEASE}")
        return len(everything) == 2 and all(ready(p) for p in everything)

    wait_for(up, 300, "the operator and the one agent Ready", lambda: explain(stack))
    (agent_pod,) = pods(stack, NS, "app.kubernetes.io/component=agent")
    assert agent_pod["spec"]["nodeName"] == agent.name
    return agent.name


@pytest.fixture(scope="module")
def engine_chart(pod_stack, tmp_path_factory) -> Path:
    return vendored_example(tmp_path_factory.mktemp("charts"), lambda *args: helm(pod_stack, *args))


def engine_values(tmp: Path, tag: str, pool: int = 0) -> Path:
    values = localimages.dev_engine_values()
    values.update(
        image=f"ferry-agent:{tag}",
        args=[MODEL_LOAD, f"--config={json.dumps(CONFIG)}", "--port=8000"],
        env=[{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
        # No GPU here: null drops the chart's nvidia.com/gpu limit (Helm merges maps).
        resources={
            "requests": {"cpu": "50m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": None},
        },
        podSecurityContext={"runAsNonRoot": True, "runAsUser": localimages.UID, "runAsGroup": localimages.GID},
        securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # Probed often, so the test sees the pod Ready soon after the load.
        probes={
            "path": "/health",
            "startup": {"periodSeconds": 2, "failureThreshold": 300},
            "readiness": {"periodSeconds": 2},
            "liveness": {"periodSeconds": 10},
        },
        modelLoad={
            "create": True,
            "modelName": MODEL,
            "desiredVersion": VERSION,
            "replicas": pool,  # 0: only where the engine runs, the weights follow its pod
            "nodeSelector": {AGENT_LABEL: "true"},
            "device": "cpu",
            "transfer": {"timeoutSeconds": 60},
        },
    )
    path = tmp / "engine-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def engine_pod(stack) -> dict | None:
    items = [p for p in pods(stack, TENANT, ENGINE_PODS) if p["metadata"].get("deletionTimestamp") is None]
    assert len(items) <= 1, [p["metadata"]["name"] for p in items]
    return items[0] if items else None


def probe_refused_503(stack, pod: str) -> bool:
    """The kubelet's Unhealthy event for the pod: its startup probe got 503 from the engine's /health."""
    selector = f"involvedObject.name={pod},reason=Unhealthy"
    out = kubectl(stack, "get", "events", "-n", TENANT, "--field-selector", selector, "-o", "json")
    return any(
        "Startup probe failed" in e.get("message", "") and "503" in e["message"] for e in json.loads(out)["items"]
    )


def rfc3339(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_example_chart_serves_the_published_weights_on_an_agent_node(pod_stack, agent_node, engine_chart, tmp_path):
    stack = pod_stack
    values = engine_values(tmp_path, stack.image_tag)
    helm(stack, "install", ENGINE, str(engine_chart), "-n", TENANT, "-f", str(values))

    # Nothing is published yet: the pod runs on the agent node, its engine serves HTTP, and /health refuses.
    def refused() -> dict | None:
        pod = engine_pod(stack)
        return (
            pod if pod and pod["spec"].get("nodeName") and probe_refused_503(stack, pod["metadata"]["name"]) else None
        )

    pod = wait_for(refused, 240, "the engine's startup probe refused (503)", lambda: explain(stack))
    name = pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == agent_node
    pod = engine_pod(stack)
    assert not ready(pod) and pod["status"]["phase"] == "Running", pod["status"]
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]

    # The trainer publishes: its own copy of the weights generates these tokens; the engine's own random
    # weights (another seed) would not.
    trainer = build_model(CONFIG, seed=7)
    expected = generate(trainer, STEPS, PROMPT)
    assert expected != generate(build_model(CONFIG, seed=1234), STEPS, PROMPT)
    source = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, str(source))
    ferry_publish(
        stack, source, version=VERSION, model=MODEL, bucket=BUCKET, tenant=TENANT, describe=lambda: explain(stack)
    )

    pod = wait_for(lambda: (p := engine_pod(stack)) and ready(p) and p, 300, "the engine Ready", lambda: explain(stack))
    assert pod["metadata"]["name"] == name and pod["spec"]["nodeName"] == agent_node
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]

    # The chart's ModelLoad followed the pod onto its node, and shows it attached.
    def attached() -> dict | None:
        ml = json.loads(kubectl(stack, "get", "ml", MODEL_LOAD, "-n", TENANT, "-o", "json"))
        c = condition(ml, "EnginesAttached")
        return ml if c.get("status") == "True" and c.get("reason") == "Attached" else None

    ml = wait_for(attached, 120, "EnginesAttached=True", lambda: explain(stack))
    assert ml["status"]["attachedPods"] == 1, ml["status"]
    (replica,) = json.loads(kubectl(stack, "get", "weightreplicas", "-n", TENANT, "-o", "json"))["items"]
    assert replica["spec"]["nodeName"] == agent_node
    assert replica["metadata"]["labels"]["ferry.dev/placement"] == "pods"
    (attachment,) = replica["status"]["attachments"]
    assert (attachment["pod"], attachment["version"]) == (name, VERSION), attachment
    # Ready through the probe only after the engine attached (both in whole seconds).
    ready_since = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    assert rfc3339(ready_since) >= rfc3339(attachment["since"]).replace(microsecond=0), (ready_since, attachment)

    # The node that serves it carries the warm label, the very key the pod's affinity prefers.
    key = ml["status"]["warmNodeLabel"]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["preference"]["matchExpressions"] == [{"key": key, "operator": "Exists"}]
    node = json.loads(kubectl(stack, "get", "node", agent_node, "-o", "json"))
    assert node["metadata"]["labels"].get(key) == VERSION, node["metadata"]["labels"]

    # A completion through the apiserver's pod proxy: the trainer's tokens.
    body = tmp_path / "request.json"
    body.write_text(json.dumps({"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0}))
    path = f"/api/v1/namespaces/{TENANT}/pods/{name}:8000/proxy/v1/completions"
    reply = json.loads(kubectl(stack, "create", "--raw", path, "-f", str(body)))
    (choice,) = reply["choices"]
    assert (reply["model"], choice["token_ids"]) == (VERSION, expected), reply


def test_a_new_engine_pod_prefers_the_warm_node(pod_stack, agent_node, engine_chart, tmp_path):
    """Both nodes agent nodes now, the ModelLoad's warm pool (1) on the node that already serves it: a replacement
    engine pod is scheduled onto that warm node, not the cold one."""
    stack = pod_stack
    (cold,) = [n.name for n in stack.nodes.nodes if n.name != agent_node]
    kubectl(stack, "label", "node", cold, f"{AGENT_LABEL}=true")
    agents = "app.kubernetes.io/component=agent"
    wait_for(
        lambda: {p["spec"]["nodeName"] for p in pods(stack, NS, agents) if ready(p)} == {cold, agent_node},
        240,
        "an agent Ready on both nodes",
        lambda: explain(stack),
    )
    values = engine_values(tmp_path, stack.image_tag, pool=1)
    helm(stack, "upgrade", ENGINE, str(engine_chart), "-n", TENANT, "-f", str(values))

    def pooled() -> bool:
        items = json.loads(kubectl(stack, "get", "weightreplicas", "-n", TENANT, "-o", "json"))["items"]
        return [(r["spec"]["nodeName"], r["metadata"]["labels"].get("ferry.dev/placement")) for r in items] == [
            (agent_node, "pool")
        ]

    wait_for(pooled, 120, f"the warm pool's one replica on {agent_node}", lambda: explain(stack))
    key = json.loads(kubectl(stack, "get", "ml", MODEL_LOAD, "-n", TENANT, "-o", "json"))["status"]["warmNodeLabel"]
    labels = {
        n: json.loads(kubectl(stack, "get", "node", n, "-o", "json"))["metadata"]["labels"] for n in (cold, agent_node)
    }
    assert key not in labels[cold] and labels[agent_node].get(key) == VERSION, labels

    old = engine_pod(stack)["metadata"]["name"]
    kubectl(stack, "delete", "pod", "-n", TENANT, old, "--wait=true", "--timeout=120s")
    pod = wait_for(
        lambda: (p := engine_pod(stack)) and p["metadata"]["name"] != old and ready(p) and p,
        300,
        "the replacement engine Ready",
        lambda: explain(stack),
    )
    assert pod["spec"]["nodeName"] == agent_node, (pod["spec"]["nodeName"], labels)
