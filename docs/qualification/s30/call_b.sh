#!/usr/bin/env bash
# Session 30, device call B: the main job, `qualify --profile gpu`, every section, from the bundle
# of call A (carried as .bundle-b30: .bundle less its test binaries and pytest files). gpu_serving runs its default
# GPU workload (8 sessions x 6 turns to 32K, both regimes) with the advise busy poll and a turn
# budget that leaves room for the sections before it inside one 600 s call.
# H: seconds the call may run. Results in $OUT/b.tar.gz.
set -u
H=${H:-585}
TS=$(date +%s)
R=$OUT/b; mkdir -p $R
B=.bundle-b30
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; command -v ip nats-server; } > $R/machine.txt 2>&1
Q=$(( H - 15 ))
KVQ_GPU_SERVING_TIMEOUT_S=$(( Q - 140 )) KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --budget-s $(( Q - 210 ))" \
  timeout $Q bash $B/run.sh qualify --profile gpu --out $R/qualify > $R/qualify.log 2>&1
echo "qualify rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b
