#!/usr/bin/env bash
# Copies the generated CRDs (crds/ferry.dev_*.yaml, from `make crds`) into the Helm chart's crds/ directory.
# The chart's copies are never edited by hand; tests/unit/test_chart_crds.py fails when they drift.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/crds"
dst="$root/charts/ferry/crds"
mkdir -p "$dst"
shopt -s nullglob
files=("$src"/ferry.dev_*.yaml)
if [ ${#files[@]} -eq 0 ]; then
  echo "no CRDs in $src (run make crds)" >&2
  exit 1
fi
# Drop chart copies whose source is gone, then copy the current set.
for f in "$dst"/ferry.dev_*.yaml; do
  [ -e "$src/$(basename "$f")" ] || rm -f "$f"
done
cp "${files[@]}" "$dst/"
echo "synced ${#files[@]} CRDs into ${dst#"$root"/}"
