#!/usr/bin/env bash
# Creates (or updates) the project venv outside the repo and installs ferry with its test tools.
set -euo pipefail
VENV=${1:?venv path}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "Python 3.11 is required (found $("$PYTHON" --version))" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade "pip>=24"
"$VENV/bin/pip" install -e ".[test]"
