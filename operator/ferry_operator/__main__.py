"""`python -m ferry_operator [settings] [kopf run options]`: the operator's settings as documented flags, in front
of `kopf run --standalone --all-namespaces -m ferry_operator.main` (what the chart runs). A flag sets its FERRY_*
variable; anything else (`--log-format=json`, `--liveness=URL`, `--verbose`) goes to `kopf run` as it is. The settings
are validated before kopf starts: a bad one exits at once, naming its flag and variable."""

from __future__ import annotations

import os
import sys

from ferry_operator.config import OperatorConfig

KOPF_RUN = ["-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "ferry_operator.main"]


def main(argv: list[str] | None = None) -> None:
    parser = OperatorConfig.parser()
    args, kopf_args = parser.parse_known_args(argv)
    given = {name: value for name, value in vars(args).items() if value is not None}
    OperatorConfig.from_values(given, os.environ, parser)
    for name, value in given.items():
        os.environ[OperatorConfig.envs(name)[0]] = value
    # The same process becomes `kopf run`: signals, exit codes and the liveness probe are kopf's, as in the chart.
    os.execv(sys.executable, [sys.executable, *KOPF_RUN, *kopf_args])


if __name__ == "__main__":
    main()
