#!/usr/bin/env bash
# Launch a chapter script with torchrun on one node or as one node of several.
#
#   bash 01-ddp-basics/launch_ddp.sh 01-ddp-basics/ddp_training.py --steps 100     # auto: all GPUs, else 4 CPU ranks
#   bash 01-ddp-basics/launch_ddp.sh --gpus 2 01-ddp-basics/ddp_training.py        # 2 processes
#   # two nodes: run on each, same --master-addr, --node-rank 0 and 1
#   bash 01-ddp-basics/launch_ddp.sh --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 01-ddp-basics/ddp_training.py
#
# Options (before the script): --gpus N (alias --nproc N), --nnodes N, --node-rank R,
# --master-addr HOST, --master-port PORT, --max-restarts N, --join-timeout S (multi-node: how long
# the agents wait for every node to join, default 300), --dry-run (print the command only).
set -euo pipefail

NPROC=auto NNODES=1 NODE_RANK=0 MASTER_ADDR_=127.0.0.1 MASTER_PORT_=29500 MAX_RESTARTS=0 DRY_RUN=0
JOIN_TIMEOUT=300
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus|--nproc|--nnodes|--node-rank|--master-addr|--master-port|--max-restarts|--join-timeout)
      if [[ $# -lt 2 ]]; then echo "error: launcher option $1 needs a value" >&2; exit 2; fi ;;&
    --gpus|--nproc) NPROC="$2"; shift 2 ;;
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --master-addr) MASTER_ADDR_="$2"; shift 2 ;;
    --master-port) MASTER_PORT_="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --join-timeout) JOIN_TIMEOUT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "error: unknown launcher option $1 (options go before the script; see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
for pair in "--nnodes:$NNODES:1" "--node-rank:$NODE_RANK:0" "--master-port:$MASTER_PORT_:1" \
            "--max-restarts:$MAX_RESTARTS:0" "--join-timeout:$JOIN_TIMEOUT:1"; do
  IFS=: read -r name value lowest <<<"$pair"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || (( 10#$value < lowest )); then
    echo "error: $name must be an integer >= $lowest, got '$value'" >&2; exit 2
  fi
done
if (( NODE_RANK >= NNODES )); then
  echo "error: --node-rank $NODE_RANK must be below --nnodes $NNODES" >&2; exit 2
fi
if [[ $# -lt 1 ]]; then
  echo "error: no training script given (usage: bash launch_ddp.sh [options] SCRIPT [ARGS...])" >&2; exit 2
fi
if [[ ! -f "$1" ]]; then
  echo "error: training script $1 does not exist" >&2; exit 2
fi

# How many processes on this node: one per GPU, or 4 CPU processes (gloo) when there is no GPU.
# GPUs are counted the way the workers will see them: through torch, so CUDA_VISIBLE_DEVICES
# applies (`nvidia-smi -L` lists every GPU of the machine, hidden ones too). No NVIDIA driver, or
# CUDA_VISIBLE_DEVICES set but empty, means no GPU without paying for the torch import.
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
GPU_COUNT=0
if command -v nvidia-smi >/dev/null 2>&1 && [[ "${CUDA_VISIBLE_DEVICES-unset}" != "" ]]; then
  GPU_COUNT=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
              2>/dev/null || echo 0)
fi
if [[ "$NPROC" == auto ]]; then
  if [[ "$GPU_COUNT" -gt 0 ]]; then NPROC=$GPU_COUNT; else NPROC=4; fi
elif ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: --gpus/--nproc must be a positive integer or auto, got '$NPROC'" >&2; exit 2
elif [[ "$GPU_COUNT" -gt 0 && "$NPROC" -gt "$GPU_COUNT" ]]; then
  echo "error: --gpus $NPROC but this node has $GPU_COUNT GPUs (NCCL needs one GPU per process)" >&2; exit 2
fi

# CPU ranks share the cores: one thread each, or 4 ranks x all cores oversubscribe the machine.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun shares its rendezvous store with the workers; after a restart, workers can then read the
# dead workers' addresses (pytorch/pytorch#135712). A fresh store per restart round avoids it.
if [[ "$MAX_RESTARTS" -gt 0 ]]; then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; fi

# NCCL environment variables worth knowing (uncomment what your cluster needs):
# export NCCL_DEBUG=INFO                  # print NCCL's topology, rings and transport choices (WARN = quiet)
# export NCCL_SOCKET_IFNAME=eth0          # the network interface NCCL's bootstrap/sockets use (not docker0/lo)
# export GLOO_SOCKET_IFNAME=eth0          # the same for gloo (CPU collectives, object collectives)
# export NCCL_IB_DISABLE=1                # no InfiniBand: fall back to TCP sockets (debug a bad IB fabric)
# export NCCL_P2P_DISABLE=1               # no GPU peer-to-peer (NVLink/PCIe): fixes hangs on broken P2P
# export NCCL_NET_GDR_LEVEL=PHB           # when GPUDirect RDMA is used between NIC and GPU
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed/timed-out collective aborts the process (default on)
# export TORCH_NCCL_BLOCKING_WAIT=1       # collectives block and raise on timeout (easier debugging, slower)
# export TORCH_DISTRIBUTED_DEBUG=DETAIL   # check that all ranks call the same collectives with the same shapes

# Node 0 hosts the rendezvous on --master-port: if something already listens there, say so in one
# line instead of letting torchrun fail with a traceback.
if [[ "$NNODES" -gt 1 && "$NODE_RANK" -eq 0 && "$DRY_RUN" -eq 0 ]] && ! "$PYTHON" - "$MASTER_ADDR_" "$MASTER_PORT_" 2>/dev/null <<'PY'
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
PY
then
  echo "error: port $MASTER_PORT_ on $MASTER_ADDR_ is already in use (or not an address of this node); pick another --master-port" >&2; exit 2
fi

if [[ "$NNODES" -eq 1 ]]; then
  RDZV=(--standalone)
else
  # join_timeout: how long each agent waits for all --nnodes agents at the rendezvous (torchrun's
  # default is 600 s, silent). A node that never starts then ends the others after this long, not
  # after --timeout-s: that one only applies once workers exist.
  RDZV=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend=c10d
        --rdzv-endpoint="$MASTER_ADDR_:$MASTER_PORT_" --rdzv-id="${RDZV_ID:-ddp-job}"
        --rdzv-conf="join_timeout=$JOIN_TIMEOUT")
fi
if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun); else TORCHRUN=("$PYTHON" -m torch.distributed.run); fi
CMD=("${TORCHRUN[@]}" "${RDZV[@]}" --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" "$@")

echo "launching $NNODES node(s) x $NPROC processes ($([[ $GPU_COUNT -gt 0 ]] && echo "$GPU_COUNT GPUs here" || echo "no GPU: CPU + gloo")):"
echo "  ${CMD[*]}"
if [[ "$DRY_RUN" -eq 1 ]]; then exit 0; fi
if [[ "$NNODES" -eq 1 ]]; then exec "${CMD[@]}"; fi

# Several nodes: say what the agents are waiting for, then watch torchrun's stderr (passed through
# unchanged) so that a rendezvous that fails ends with one line saying why, not only a traceback.
echo "node $NODE_RANK of $NNODES: waiting up to ${JOIN_TIMEOUT} s (--join-timeout) for all $NNODES nodes to join the rendezvous at $MASTER_ADDR_:$MASTER_PORT_"
read -r -d '' WATCH <<'PY' || true
import os, signal, subprocess, sys

where, nnodes, join_timeout, *cmd = sys.argv[1:]
# Its own session: a Ctrl-C reaches torchrun once, forwarded from here, not twice.
child = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda signum, frame: child.send_signal(signum))
seen, tail = set(), b""
keys = (b"RendezvousTimeoutError", b"RendezvousConnectionError", b"RendezvousClosedError")
while chunk := os.read(child.stderr.fileno(), 65536):
    os.write(2, chunk)
    seen.update(key for key in keys if key in tail + chunk)
    tail = chunk[-64:]
code = child.wait()
if code != 0 and keys[0] in seen:
    print(f"error: the rendezvous at {where} timed out: not all {nnodes} nodes joined within "
          f"{join_timeout} s (--join-timeout); check that every node runs launch_ddp.sh with the same "
          "--nnodes, --master-addr and --master-port", file=sys.stderr, flush=True)
elif code != 0 and keys[2] in seen:
    print(f"error: the rendezvous at {where} was closed by another node's agent (it timed out "
          "waiting for the other nodes, or failed: see the other nodes' output)", file=sys.stderr, flush=True)
elif code != 0 and keys[1] in seen:
    print(f"error: lost the rendezvous at {where}: the agent that hosts it (on the --master-addr node) "
          "exited or cannot be reached; see that node's output", file=sys.stderr, flush=True)
sys.exit(code if code >= 0 else 128 - code)
PY
exec "$PYTHON" -c "$WATCH" "$MASTER_ADDR_:$MASTER_PORT_" "$NNODES" "$JOIN_TIMEOUT" "${CMD[@]}"
