#!/usr/bin/env bash
# Builds the real control-plane binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet),
# helm and kube-score from Go modules into a cache outside the repo. Rebuilds only when the pins below change.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
HELM_VERSION=${HELM_VERSION:-v3.21.4}
KUBE_SCORE_VERSION=${KUBE_SCORE_VERSION:-v1.20.0}
CACHE=${FERRY_CACHE:-$HOME/.cache/ferry}
BIN=$CACHE/bin
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
mkdir -p "$BIN" "$CACHE/src"

stamp_ok() { [ -x "$BIN/$1" ] && [ "$(cat "$BIN/.$1.pin" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" >"$BIN/.$1.pin"; }

build_etcd() {
  stamp_ok etcd "$ETCD_VERSION" && return
  local d=$CACHE/src/etcd-$ETCD_VERSION
  mkdir -p "$d" && cd "$d"
  [ -f go.mod ] || go mod init ferry.local/etcd-wrapper >/dev/null 2>&1
  cat >tools.go <<GO
//go:build tools
package tools
import _ "go.etcd.io/etcd/server/v3"
GO
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  go build -trimpath -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  stamp etcd "$ETCD_VERSION"
}

build_k8s() {
  local cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet) c missing=0
  for c in "${cmds[@]}"; do stamp_ok "$c" "$K8S_VERSION" || missing=1; done
  [ $missing = 0 ] && return
  local d=$CACHE/src/k8s-$K8S_VERSION staging_version="v0.${K8S_VERSION#v1.}"
  mkdir -p "$d" && cd "$d"
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  local go_line godebug
  go_line=$(grep -E '^go [0-9]' "$gomod")
  godebug=$(grep -E '^godebug ' "$gomod" || true)
  {
    echo "module ferry.local/k8s-wrapper"
    echo "$go_line"
    [ -n "$godebug" ] && echo "$godebug"
    echo "require k8s.io/kubernetes $K8S_VERSION"
  } >go.mod
  # Every staging module is required at v0.0.0 upstream; route each to its published v0.X.Y.
  grep -oE 'k8s\.io/[a-z0-9-]+ => \./staging/src/k8s\.io/[a-z0-9-]+' "$gomod" | awk '{print $1}' | sort -u | while read -r m; do
    go mod edit -replace="$m=$m@$staging_version"
  done
  cat >tools.go <<GO
//go:build tools
package tools
import (
  _ "k8s.io/kubernetes/cmd/kube-apiserver"
  _ "k8s.io/kubernetes/cmd/kube-controller-manager"
  _ "k8s.io/kubernetes/cmd/kube-scheduler"
  _ "k8s.io/kubernetes/cmd/kubelet"
)
GO
  go mod tidy
  local ver=${K8S_VERSION#v} pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=${ver%%.*} -X $pkg.gitMinor=$(echo "$ver" | cut -d. -f2) -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  for c in "${cmds[@]}"; do
    stamp_ok "$c" "$K8S_VERSION" && continue
    go build -trimpath -ldflags "$ldflags" -o "$BIN/$c" "k8s.io/kubernetes/cmd/$c"
    stamp "$c" "$K8S_VERSION"
  done
}

build_helm() {
  stamp_ok helm "$HELM_VERSION" && return
  local minor
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  GOBIN=$BIN go install -trimpath -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  stamp helm "$HELM_VERSION"
}

# The third-party manifest linter the chart is checked with (tests/cluster/test_kube_score.py).
build_kube_score() {
  stamp_ok kube-score "$KUBE_SCORE_VERSION" && return
  GOBIN=$BIN go install -trimpath -ldflags "-X main.version=$KUBE_SCORE_VERSION" "github.com/zegl/kube-score/cmd/kube-score@$KUBE_SCORE_VERSION"
  stamp kube-score "$KUBE_SCORE_VERSION"
}

what=${1:-all}
case $what in
  etcd) build_etcd ;;
  k8s) build_k8s ;;
  helm) build_helm ;;
  kube-score) build_kube_score ;;
  all) (build_etcd) && (build_helm) && (build_kube_score) && (build_k8s) ;;
  *) echo "usage: $0 [all|etcd|k8s|helm|kube-score]" >&2; exit 2 ;;
esac
echo "binaries in $BIN"
