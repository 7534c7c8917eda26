"""The real operator (`kopf run` subprocess) for e2e tests: a handle that starts, kills and restarts it, and the
address of its metrics."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

from ferry_dev.localcluster import LocalCluster, ManagedProcess, S3Server, start_operator, wait_until

# No resync interval: the operator has no periodic timers, so every test here shows that events (and deadlines)
# alone drive it. A blocked release's safety net is longer than any test waits: a release must be woken.
OPERATOR_ENV = {
    "FERRY_VERIFY_BACKOFF_SECONDS": "1",
    "FERRY_VERIFY_BACKOFF_MAX_SECONDS": "4",
    "FERRY_RELEASE_RETRY_SECONDS": "3600",
}


class OperatorHandle:
    """Starts, kills and restarts the operator process; tests may crash it on purpose."""

    handles: ClassVar[list[OperatorHandle]] = []  # of this test process, for `stop_all`

    def __init__(self, cluster: LocalCluster, s3: S3Server, workdir) -> None:
        self.cluster, self.s3, self.workdir = cluster, s3, workdir
        self.process: ManagedProcess | None = None
        self.starts = 0
        self.metrics_url = ""
        self.handles.append(self)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every operator this test process runs (the next `ensure_running` starts it again)."""
        for handle in cls.handles:
            handle.stop()

    def start(self) -> ManagedProcess:
        self.starts += 1
        self.process = self.spawn(f"operator-{self.starts}")
        self.metrics_url = metrics_url(self.process)
        return self.process

    def spawn(self, name: str, env: dict[str, str] | None = None, args: Sequence[str] = ()) -> ManagedProcess:
        """Another operator process (e.g. a leader-election candidate), started up to its metrics endpoint."""
        process = start_operator(
            self.cluster, self.workdir, env={**self.s3.env(), **OPERATOR_ENV, **(env or {})}, name=name, args=args
        )
        wait_until(lambda: "metrics on" in process.log_tail(200), 30, f"{name} startup", process)
        return process

    def ensure_running(self) -> None:
        if self.process is None or not self.process.alive:
            self.start()

    def kill(self) -> None:
        if self.process:
            self.process.kill()

    def stop(self) -> None:
        if self.process:
            self.process.stop()


def metrics_url(process: ManagedProcess) -> str:
    """The URL the operator logged its metrics at."""
    match = re.search(r"metrics on (http://\S+)", process.log_path.read_text(errors="replace"))
    assert match, process.log_tail()
    return match.group(1)
