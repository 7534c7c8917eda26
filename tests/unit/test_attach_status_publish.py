"""`status.attachments` from the attach server's leases over a real Unix socket: what the agent patches when a
consumer attaches, refits, releases or dies, and what the resync corrects."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from ferry.api.models import MAX_ATTACHMENTS
from ferry.client import attach
from ferry_agent.attach.memstore import seal_tensors
from ferry_agent.attach.server import AttachServer, Offer, Pod
from ferry_agent.attach.status import AttachmentPublisher, attachment_status

pytestmark = pytest.mark.unit

KEY = ("ns", "ml-node")


class Recorder:
    """The agent's `_patch_status`, recorded: the last status fields patched per replica."""

    def __init__(self) -> None:
        self.patches: list[tuple[tuple[str, str], dict]] = []
        self.lock = threading.Lock()

    def __call__(self, key, status) -> None:
        with self.lock:
            self.patches.append((key, status))

    def last(self, key=KEY) -> dict | None:
        with self.lock:
            return next((s for k, s in reversed(self.patches) if k == key), None)


@pytest.fixture
def server():
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))  # sun_path is short: no pytest tmp_path
    srv = AttachServer(root)
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


def offer(server: AttachServer, version: str) -> None:
    gen = torch.Generator().manual_seed(len(version))
    sealed = seal_tensors({"w": torch.randn(8, generator=gen)}, f"ns/m/{version}")
    server.offer(KEY, Offer("ns", "ml", "m", version, f"uid-{version}", sealed))


def add_pod(server: AttachServer, name: str) -> tuple[Pod, Path]:
    pod = Pod(str(uuid.uuid4()), "ns", name)
    server.add_pod(pod)
    return pod, server.pods_dir / pod.uid


def eventually(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
    return value


def held(recorder: Recorder) -> list[tuple[str, str]] | None:
    status = recorder.last()
    return None if status is None else [(e["pod"], e["version"]) for e in status["attachments"]]


def test_attach_refit_release_and_close_are_patched(server):
    recorder = Recorder()
    publisher = AttachmentPublisher(server, recorder, settle_s=0.05)
    publisher.start()
    try:
        offer(server, "v1")
        a, a_dir = add_pod(server, "engine-a")
        _, b_dir = add_pod(server, "engine-b")
        first = attach("ml", socket_dir=a_dir, timeout=5)
        second = attach("ml", socket_dir=a_dir, timeout=5)  # a second connection of the same pod: one entry
        eventually(lambda: held(recorder) == [("engine-a", "v1")])
        status = recorder.last()
        assert status["attachedPods"] == 1
        entry = status["attachments"][0]
        assert entry["podUid"] == a.uid and entry["podNamespace"] == "ns" and "rank" not in entry
        assert entry["since"].endswith("Z")

        with attach("ml", socket_dir=b_dir, timeout=5, rank=0):
            eventually(lambda: held(recorder) == [("engine-a", "v1"), ("engine-b", "v1")])
            assert recorder.last()["attachedPods"] == 2
            assert recorder.last()["attachments"][1]["rank"] == 0
        eventually(lambda: held(recorder) == [("engine-a", "v1")])

        # Make before break: the pod holds both versions until it lets the old one go.
        offer(server, "v2")
        refit = attach("ml", socket_dir=a_dir, version="v2", timeout=5)
        eventually(lambda: held(recorder) == [("engine-a", "v1"), ("engine-a", "v2")])
        assert recorder.last()["attachedPods"] == 1
        first.close()
        second.close()
        eventually(lambda: held(recorder) == [("engine-a", "v2")])
        refit.close()
        eventually(lambda: held(recorder) == [])
        assert recorder.last() == {"attachments": [], "attachedPods": 0}
    finally:
        publisher.stop()


def test_a_killed_consumer_is_dropped(server):
    recorder = Recorder()
    publisher = AttachmentPublisher(server, recorder, settle_s=0.05)
    publisher.start()
    offer(server, "v1")
    _, pod_dir = add_pod(server, "engine")
    code = (
        "import sys, time; from ferry.client import attach\n"
        f"w = attach('ml', socket_dir={str(pod_dir)!r}, timeout=5); print('ok', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ok"
        eventually(lambda: held(recorder) == [("engine", "v1")])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        eventually(lambda: held(recorder) == [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        publisher.stop()


def test_resync_clears_what_the_object_says_and_nobody_holds(server):
    recorder = Recorder()
    publisher = AttachmentPublisher(server, recorder)  # not started: only the resync writes
    stale = {"pod": "gone", "podNamespace": "ns", "podUid": str(uuid.uuid4()), "version": "v1", "since": "x"}
    publisher.publish(observed={KEY: {"attachments": [stale], "attachedPods": 1}, ("ns", "other"): None})
    assert recorder.patches == [(KEY, {"attachments": [], "attachedPods": 0})]
    # The object now agrees: nothing more is written, for it or for a replica that never had consumers.
    publisher.publish(observed={KEY: {"attachments": [], "attachedPods": 0}, ("ns", "other"): {}})
    publisher.publish()
    assert len(recorder.patches) == 1

    offer(server, "v1")
    _, pod_dir = add_pod(server, "engine")
    with attach("ml", socket_dir=pod_dir, timeout=5):
        publisher.publish()
        assert held(recorder) == [("engine", "v1")]
        entries = recorder.last()["attachments"]
        # The object lost the write (a status overwritten meanwhile): the resync writes it again.
        publisher.publish(observed={KEY: {}})
        assert len(recorder.patches) == 3 and recorder.last()["attachments"] == entries
        publisher.publish(observed={KEY: {"attachments": entries, "attachedPods": 1}})
        assert len(recorder.patches) == 3
        # A count the object lost is written again too.
        publisher.publish(observed={KEY: {"attachments": entries}})
        assert len(recorder.patches) == 4 and recorder.last()["attachedPods"] == 1


def test_the_list_is_cut_at_what_the_crd_admits_and_the_count_is_of_all():
    entries = [{"pod": f"p{i}", "podNamespace": "ns", "podUid": f"u{i}", "version": "v1"} for i in range(1100)]
    status = attachment_status(entries)
    assert len(status["attachments"]) == MAX_ATTACHMENTS and status["attachedPods"] == 1100
