#!/usr/bin/env bash
# Session 30, device call E (issue 19 on an H200, after calls D and B ran on an H100): the
# transfer bench at the 16 MiB default, at 8 MiB, and at the default again (same carry as call D).
# Results in $OUT/e.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/e; mkdir -p $R
B=.bundle-a30
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for run in default-1 8192-1 default-2; do
  first=${run%-*}
  if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
  env $env timeout 40 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
    --json $R/transfer-$run.json > $R/transfer-$run.log 2>&1
  echo "transfer $run rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done
cd $OUT && tar czf e.tar.gz e && rm -rf e
