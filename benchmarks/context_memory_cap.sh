#!/usr/bin/env bash
# A block one process cannot hold: context-parallel GPT training (qkv_benchmarks.train_mpi,
# --mode context) with every rank in a Linux memory cgroup (v1) of CAP bytes, as if each
# process were a machine of that size. Needs root and /sys/fs/cgroup/memory.
#
#   benchmarks/context_memory_cap.sh W T CAP      e.g.  4 16384 512M  (trains)
#                                                        1 16384 512M  (killed: out of memory)
set -euo pipefail
W=${1:?ranks}; T=${2:?block size}; CAP=${3:?memory per rank, e.g. 512M}
cd "$(dirname "$0")/.."
exec .venv/bin/mpiexec -n "$W" sh -c '
  d=/sys/fs/cgroup/memory/qkv-cap-$PMI_RANK
  mkdir -p "$d"; echo 0 > "$d/memory.max_usage_in_bytes"
  echo '"$CAP"' > "$d/memory.limit_in_bytes"; echo $$ > "$d/tasks"
  .venv/bin/python -m mpi4py -m qkv_benchmarks.train_mpi --mode context --block-size '"$T"' \
      --batch-size 1 --repeats 1 --single none
  status=$?
  echo "rank $PMI_RANK: peak $(( $(cat "$d/memory.max_usage_in_bytes") / 1048576 )) MiB of '"$CAP"'" >&2
  exit $status'
