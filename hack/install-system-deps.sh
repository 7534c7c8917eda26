#!/usr/bin/env bash
# Installs the Debian packages that `make test`, `make demo` and `make e2e-pods` need, when any is missing.
# Run as root it installs them itself; otherwise it stops at once with the one command that does.
set -euo pipefail

need=()
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
command -v nsenter >/dev/null || need+=(util-linux)
command -v git >/dev/null || need+=(git)
command -v pgrep >/dev/null || need+=(procps)  # the multi-rank e2e test finds rank processes with it
# Real pods (tests/pods): a container runtime per kubelet node, CNI bridges, the apiserver forwarder, the dev images'
# rootfs (debootstrap) and the static pause binary (gcc).
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v socat >/dev/null || need+=(socat)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v gcc >/dev/null || need+=(gcc libc6-dev)

# Debian's Go is older than the Kubernetes modules need: Go comes from the machine (go.dev toolchain, 1.25+).
command -v go >/dev/null || { echo "Go 1.25 or newer is required to build etcd, kube-apiserver and helm" >&2; exit 1; }
[ ${#need[@]} -eq 0 ] && exit 0
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if [ "$(id -u)" != 0 ]; then
  echo "missing system packages; install them with:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "installing system packages: ${need[*]}"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
