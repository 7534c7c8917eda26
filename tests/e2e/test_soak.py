"""A bounded RL soak in the suite (`ferry_dev.soak`; bench/soak_rl.py runs it long): steps published one after
another from the publish API, the desiredVersion moved to each at once, retention on with deleteStorage, three real
agents over S3 and a real engine process following every step with watch + attach + load_into(only_changed=True)."""

from __future__ import annotations

import json

import pytest

from ferry_dev.soak import SoakConfig, run_soak, step_name

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("rollout", ["Parallel", "Rolling"])
def test_every_step_reaches_the_engine_in_order_with_its_bytes(
    cluster, s3, namespace, operator, tmp_path, socket_root, rollout
):
    cfg = SoakConfig(steps=24, agents=3, keyframe_every=8, keep_last=3, rollout=rollout)
    report = run_soak(cluster, s3, tmp_path, namespace, cfg, socket_root)
    summary = json.dumps(report.summary(), indent=1)
    last = step_name(cfg.steps - 1)

    assert report.served_last == {r: last for r in report.served_last} and len(report.served_last) == 3, summary
    held = [h for h in report.holds if "sha256" in h]
    assert held and held[-1]["version"] == last, summary
    assert report.wrong_bytes == [], summary
    assert report.backward_holds == 0, summary
    assert report.backward_moves == [], summary
    # Retention: exactly the newest keepLast steps and the chains they replay from are left in S3.
    assert report.s3_left == report.s3_expected, summary
