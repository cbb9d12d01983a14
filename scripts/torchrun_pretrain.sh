#!/usr/bin/env bash
# Multi-GPU / multi-node `vitlab fit` under torchrun. Run the same command on every node; torchrun
# starts one process per GPU and Lightning reads the ranks from torchrun's environment
# (TorchElasticEnvironment), so it does not launch processes itself.
#
#   scripts/torchrun_pretrain.sh RECIPE RUN_DIR [DATA] [-- extra vitlab flags]
#
# Environment:
#   NNODES          number of nodes (default 1)
#   NPROC_PER_NODE  GPUs per node (default: all GPUs nvidia-smi lists)
#   RDZV_ENDPOINT   host:port of the rendezvous, reachable from every node (default
#                   $MASTER_ADDR:$MASTER_PORT, else localhost:29500); node ranks are assigned by it
#   RDZV_ID         job id shared by the nodes of one job (default: vitlab-<run dir name>)
#   NODE_RANK       set it to use a static rendezvous instead (node 0 at MASTER_ADDR:MASTER_PORT)
#   TORCHRUN        the torchrun executable (default: torchrun next to this venv's python, else PATH)
#
# Example, 2 nodes x 8 GPUs, on both nodes:
#   NNODES=2 RDZV_ENDPOINT=node001:29500 scripts/torchrun_pretrain.sh \
#       recipes/pretrain/imagenet21k_vit_base16.yaml runs/vit_b21k /data/imagenet21k
# Resuming: add `-- --ckpt_path last` (the same run folder continues, with the same wandb run).
set -euo pipefail

usage() { sed -n '5,6p' "$0" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
RECIPE=$1; RUN_DIR=$2; shift 2
DATA=""
if [[ $# -gt 0 && $1 != "--" ]]; then DATA=$1; shift; fi
[[ ${1:-} == "--" ]] && shift

NNODES=${NNODES:-1}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ $NPROC_PER_NODE -ge 1 ]] || { echo "no GPU found; set NPROC_PER_NODE" >&2; exit 2; }
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${TORCHRUN:-} ]]; then
    TORCHRUN=$HERE/.venv/bin/torchrun
    [[ -x $TORCHRUN ]] || TORCHRUN=torchrun
fi

if [[ -n ${NODE_RANK:-} ]]; then
    RDZV=(--node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}")
else
    RDZV=(--rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:-${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}}"
          --rdzv_id "${RDZV_ID:-vitlab-$(basename "$RUN_DIR")}")
fi

# --max_restarts 0: a failed rank ends the job (torchrun stops the other ranks); resume with --ckpt_path last.
exec "$TORCHRUN" --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" "${RDZV[@]}" --max_restarts 0 \
    -m vitlab.cli fit --config "$RECIPE" --run_dir "$RUN_DIR" \
    --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE" \
    ${DATA:+--data_path "$DATA"} "$@"
