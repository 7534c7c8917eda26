#!/usr/bin/env bash
# Usage: hack/gen-proto.sh [PYTHON]
# Regenerates the agent's gRPC stubs from agent/ferry_agent/transport/proto/*.proto. The generated files are committed;
# rerun this after editing a .proto. The include root is agent/, so the stubs import each other as
# `ferry_agent.transport.proto.<name>_pb2` and no import fix-up is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-$HOME/.cache/ferry/venv/bin/python}}
"$PY" -m grpc_tools.protoc -I agent \
  --python_out=agent --pyi_out=agent --grpc_python_out=agent \
  agent/ferry_agent/transport/proto/*.proto
touch agent/ferry_agent/transport/proto/__init__.py
