# Sourced by test.sh (and run by the real-KVM tests): start virtlogd and libvirtd if qemu:///system does not
# answer (no systemd here: the daemons run directly), and libvirt's default network. Needs /dev/kvm for guests.
ensure_libvirtd() {
  # QEMU runs as libvirt-qemu (group kvm): give /dev/kvm the mode udev's rule gives it where udev does not run
  if [ -c /dev/kvm ] && getent group kvm >/dev/null && [ "$(stat -c %G:%a /dev/kvm)" != "kvm:660" ]; then
    chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
  fi
  if ! virsh -q -c qemu:///system version >/dev/null 2>&1; then
    command -v libvirtd >/dev/null || { echo "libvirtd is not installed: run scripts/bootstrap.sh --dev" >&2; return 1; }
    echo "starting virtlogd and libvirtd"
    pgrep -x virtlogd >/dev/null || virtlogd -d
    pgrep -x libvirtd >/dev/null || libvirtd -d
    for _ in $(seq 1 30); do virsh -q -c qemu:///system version >/dev/null 2>&1 && break; sleep 1; done
    virsh -q -c qemu:///system version >/dev/null || { echo "libvirtd did not come up" >&2; return 1; }
  fi
  # Read the state first: `virsh ... | grep -q` fails under pipefail when grep stops reading early (SIGPIPE).
  local net
  net=$(virsh -q -c qemu:///system net-info default 2>/dev/null || true)
  if ! [[ "$net" =~ Active:\ *yes ]]; then
    virsh -q -c qemu:///system net-start default >/dev/null 2>&1 \
      || virsh -q -c qemu:///system net-info default | grep -E '^Active: *yes' >/dev/null
  fi
}
