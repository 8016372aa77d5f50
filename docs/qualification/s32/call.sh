#!/usr/bin/env bash
# Session 32 device calls, from the bundle of `cargo xtask gpu-bundle` at 6134589 (carried as
# .bundle). Steps, in the order given:
#   transfer  issue 19: `kvq bench transfer --profile gpu --repeats 10` at the 16 MiB default, twice
#   pytest    the wheel's GPU tests (`run.sh pytest-gpu`: test_gpu.py, torch CUDA tensors)
#   qualify   the main job, `qualify --profile gpu`, every section, gpu_serving's full default
#             workload (8 sessions x 6 turns to 32K, both regimes) with the advise busy poll and
#             no turn budget; it gets what is left of H
# H: seconds the call may run. Results in $OUT/<NAME>.tar.gz, NAME=${NAME:-f}.
set -u
H=${H:-585}
NAME=${NAME:-f}
TS=$(date +%s)
R=$OUT/$NAME; mkdir -p $R
B=${B:-.bundle}   # .bundle-e: the same bundle without nats-server (transfer and pytest need none)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; } > $R/machine.txt 2>&1
left() { echo $(( H - ($(date +%s) - TS) )); }
for step in "$@"; do
  case $step in
    transfer)
      for run in 1 2; do
        timeout 45 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
          --json $R/transfer-default-$run.json > $R/transfer-default-$run.log 2>&1
        echo "transfer default-$run rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
      done ;;
    pytest)
      timeout 150 bash $B/run.sh pytest-gpu > $R/pytest-gpu.log 2>&1
      echo "pytest-gpu rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt ;;
    qualify)
      Q=$(( $(left) - 15 ))
      KVQ_GPU_SERVING_TIMEOUT_S=$(( Q - 40 )) KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000" \
        timeout $Q bash $B/run.sh qualify --profile gpu --out $R/qualify > $R/qualify.log 2>&1
      echo "qualify rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt ;;
  esac
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
