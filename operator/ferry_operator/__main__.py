"""`python -m ferry_operator [settings] [kopf run options]`: the operator's settings as documented flags, in front
of `kopf run --standalone --all-namespaces -m ferry_operator.main` (what the chart runs). A flag sets its FERRY_*
variable; anything else (`--log-format=json`, `--liveness=URL`, `--verbose`) goes to `kopf run` as it is."""

from __future__ import annotations

import argparse
import os
import sys

from ferry_operator.config import SETTINGS

KOPF_RUN = ["-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "ferry_operator.main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ferry_operator",
        description="Ferry's operator. Each setting is a FERRY_* environment variable (as the Helm chart sets "
        "them) or the flag beside it, which wins.",
        epilog="Other options go to `kopf run` (see `python -m kopf run --help`), e.g. --log-format=json, "
        "--liveness=http://0.0.0.0:8081/healthz, --verbose.",
    )
    for s in SETTINGS:
        default = f"default: {s.default}" if s.default else "default: unset"
        p.add_argument(s.flag, dest=s.env, metavar="VALUE", help=f"{s.help} [{s.env}; {default}]")
    return p


def main(argv: list[str] | None = None) -> None:
    args, kopf_args = parser().parse_known_args(argv)
    for s in SETTINGS:
        value = getattr(args, s.env)
        if value is not None:
            os.environ[s.env] = value
    # The same process becomes `kopf run`: signals, exit codes and the liveness probe are kopf's, as in the chart.
    os.execv(sys.executable, [sys.executable, *KOPF_RUN, *kopf_args])


if __name__ == "__main__":
    main()
