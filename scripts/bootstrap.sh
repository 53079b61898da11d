#!/usr/bin/env bash
# Installs what vgpu-ctl needs on Debian/Ubuntu: system packages (libvirt headers for libvirt-python,
# libvirt's RelaxNG schemas, and with --dev PostgreSQL for the tests), then a virtualenv in .venv.
# Idempotent: a second run only checks. Usage: scripts/bootstrap.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0; [ "${1:-}" = "--dev" ] && dev=1

need=()
dpkg -s libvirt-dev >/dev/null 2>&1 || need+=(libvirt-dev)
dpkg -s pkg-config >/dev/null 2>&1 || need+=(pkg-config)
dpkg -s libvirt0 >/dev/null 2>&1 || need+=(libvirt0)
dpkg -s python3-venv >/dev/null 2>&1 || python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
dpkg -s gcc >/dev/null 2>&1 || command -v gcc >/dev/null || need+=(gcc)
python3 -c 'import sysconfig,os,sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")) else 1)' \
  || need+=(python3-dev)
if [ "$dev" = 1 ]; then
  dpkg -s postgresql >/dev/null 2>&1 || command -v pg_ctlcluster >/dev/null || need+=(postgresql)
  # real libvirtd + KVM for the host tests (guests need /dev/kvm); dnsmasq-base runs the default network
  for p in libvirt-daemon-system libvirt-daemon-driver-qemu qemu-system-x86 qemu-utils libvirt-clients dnsmasq-base chromium prometheus; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
fi
if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "vgpu-ctl needs these system packages: ${need[*]} (Debian/Ubuntu names)." >&2
    echo "This system has no apt-get: install their equivalents with your package manager, then rerun." >&2
    exit 1
  fi
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing system packages: ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.installed-$dev-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  if [ "$dev" = 1 ]; then .venv/bin/pip install -q -e '.[dev]'; else .venv/bin/pip install -q -e .; fi
  rm -f .venv/.installed-*; touch "$stamp"
fi
