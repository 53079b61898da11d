#!/usr/bin/env bash
# The main job on the embedded default: a SQLite store and the demo fleet on simulated hosts (every domain
# rendered, validated against libvirt's schema and parsed by libvirt's test driver). Sets up what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export VGPU_CTL_STATE_DIR="${VGPU_CTL_STATE_DIR:-$PWD/var/demo}"
unset VGPU_CTL_DATABASE_URL
rm -rf "$VGPU_CTL_STATE_DIR"
v() { echo "+ vgpuctl $*"; .venv/bin/vgpuctl "$@"; }
# The base disk image every domain's overlay stands on (the domain XML points at it; a libvirt host makes each
# VM's overlay from it). Simulated hosts run no guests, so an empty 1 GiB image is enough.
mkdir -p "$VGPU_CTL_STATE_DIR/images"
if command -v qemu-img >/dev/null; then
  qemu-img create -q -f qcow2 "$VGPU_CTL_STATE_DIR/images/base.qcow2" 1G
else
  echo "qemu-img not found (apt-get install qemu-utils): the demo's domains name $VGPU_CTL_STATE_DIR/images/base.qcow2," \
       "which is not created" >&2
fi

v --version
v init
v inventory apply inventory/demo.yaml
v inventory apply inventory/demo.yaml            # applying again changes nothing
v pool list
v tenant create acme
v tenant create globex
v quota set acme --vgpus 6 --framebuffer 200GiB
v quota set globex --pool inference --profile H100-1-10C=3
v vm create --tenant acme --name train-a --profile A100D-40C --vcpus 16 --memory 64GiB --pool training
v vm create --tenant acme --name train-b --profile A100-80GB --vcpus 32 --memory 128GiB --pool training
v vm create --tenant acme --name mig-a --profile H100-3-40C --vcpus 8 --memory 32GiB --pool inference
v vm create --tenant globex --name infer-1 --profile H100-1-10C --vcpus 4 --memory 16GiB --pool inference
v vm create --tenant globex --name infer-2 --profile H100-1-10C --vcpus 4 --memory 16GiB --pool inference
v vm create --tenant globex --name infer-3 --profile A100D-10C --vcpus 4 --memory 16GiB --pool inference
v vm create --tenant globex --name ws-1 --profile L40S-12C --vcpus 8 --memory 32GiB --pool workstations
v vm create --tenant globex --name ws-2 --profile L40S-24C --vcpus 8 --memory 32GiB --pool workstations
echo "# refusals explain themselves (exit code 3):"
v vm create --tenant acme --name too-big --profile A100D-40C --count 3 --vcpus 8 --memory 32GiB || true
v vm create --tenant globex --name infer-4 --profile H100-1-10C --count 2 --vcpus 4 --memory 16GiB \
  --pool inference || true
v vm list
v tenant usage acme
v status
v host cordon kvm-l40s-01                        # no new VMs there; its VMs stay
v host uncordon kvm-l40s-01
v vm xml acme/train-a | head -n 40
v vm delete acme/train-b

echo "# the same store as a service: a tenant with only a token and the server's URL"
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/vgpuctl serve --listen "127.0.0.1:$port" --reconcile-interval 0 --log-level warning &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
.venv/bin/python - "$port" <<'PY'  # wait until it answers (httpx comes with vgpu-ctl; curl may not be installed)
import sys, time, httpx
for _ in range(200):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1).status_code == 200:
            break
    except httpx.TransportError:
        time.sleep(0.1)
else:
    sys.exit("vgpuctl serve did not answer /healthz within 20 s")
PY
token=$(.venv/bin/vgpuctl tenant token acme)
r() { echo "+ vgpuctl --server http://127.0.0.1:$port $*"; VGPU_CTL_TOKEN="$token" .venv/bin/vgpuctl --server "http://127.0.0.1:$port" "$@"; }
r vm create --tenant acme --name remote-1 --profile H100-1-10C --vcpus 4 --memory 16GiB --pool inference
r vm list
r vm delete acme/remote-1
r vm show globex/infer-1 || true                 # another tenant's VM: not found (exit 4)
kill -TERM $server && wait $server               # SIGTERM drains in-flight work, then exits 0
trap - EXIT
echo "# scheduling: a preemptible batch VM gives way to a prod one, waits in the queue, and runs again"
v tenant create beta
v priority create batch --value 10 --preemptible   # its VMs may be preempted (requeued)
v priority create prod --value 1000                # may preempt lower-priority preemptible VMs
v tenant set acme --priority-classes batch --default-priority batch --shares 2
v vm create --tenant acme --name batch-1 --profile A100-80GB --vcpus 4 --memory 8GiB --pool training
v vm create --tenant beta --name serve-1 --profile A100-80GB --vcpus 4 --memory 8GiB --pool training \
  --priority prod --preempt --dry-run              # the victims, before anything happens
v vm create --tenant beta --name serve-1 --profile A100-80GB --vcpus 4 --memory 8GiB --pool training --priority prod
v vm create --tenant beta --name serve-2 --profile A100-80GB --vcpus 4 --memory 8GiB --pool training \
  --priority prod --queue                          # nothing lower to preempt (serve-1 is prod): it waits
v queue                                            # serve-2 first (prod), then acme/batch-1, requeued with its id
v share
v vm delete beta/serve-1                           # capacity frees: the queue admits beta/serve-2
v queue                                            # acme/batch-1 still waits
v vm delete beta/serve-2                           # and now acme/batch-1 runs again
v vm show acme/batch-1
v events -o wide | grep -E ' vm\.(preempt|preempted|queue|admit) '   # the story, in the audit trail
echo "demo store: $VGPU_CTL_STATE_DIR/vgpu-ctl.db"
