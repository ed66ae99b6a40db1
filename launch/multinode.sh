#!/usr/bin/env bash
# One job over several machines without a scheduler: run this on every machine.
#
#   COORDINATOR=node0:12355 NNODES=2 NODE_RANK=0 bash launch/multinode.sh --config configs/small.yaml
#   COORDINATOR=node0:12355 NNODES=2 NODE_RANK=1 bash launch/multinode.sh --config configs/small.yaml
#
# COORDINATOR  host:port reachable from every machine; process 0 (on NODE_RANK 0) serves it
# NNODES       machines in the job
# NODE_RANK    this machine, 0 .. NNODES-1
# PROCS_PER_NODE  processes per machine (default 1; set it to the GPU count with GPUS=1)
# GPUS=1       one GPU per process
#
# Every machine needs the same code, config and data, and train.output_dir on a shared
# filesystem (checkpoints are written collectively).
set -euo pipefail
: "${COORDINATOR:?set COORDINATOR=host:port of node 0}"
: "${NNODES:?set NNODES=number of machines}"
: "${NODE_RANK:?set NODE_RANK=this machine (0 .. NNODES-1)}"
gpus=()
if [[ "${GPUS:-0}" == 1 ]]; then gpus=(--gpus); fi
exec python -m jaxmllm.launch --nodes "$NNODES" --node-rank "$NODE_RANK" \
  --coordinator "$COORDINATOR" --processes "${PROCS_PER_NODE:-1}" "${gpus[@]}" "$@"
