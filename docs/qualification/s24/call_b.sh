#!/usr/bin/env bash
# Session 24, device call B (one lease): (1) the wheel's gate tests on torch and
# the kv-transfer consumer-stream GPU tests (the layered release is new);
# (2) the layer-by-layer fetch release against the whole-fetch gate in the
# churn regime of the issue-21 workload, alternated layers / on / layers on
# one lease (--fetch-overlap layers --layer-groups 8 vs --fetch-overlap on),
# advise busy poll on at both ends. B_EXTRA: more harness arguments (an 80 GB
# card: "--sessions 4", as the H100 A/B calls of session 22); B_RUN_S: the
# limit per serving run. Carry .bundle; results tarred into $OUT/b.tar.gz.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1
timeout 60 bash .bundle/run.sh pytest-gpu test_gpu.py -k gate > $R/pytest_gate.log 2>&1; echo "pytest gate rc=$?" >> $R/rc.txt
timeout 40 bash .bundle/run.sh tests consumer > $R/tests_consumer.log 2>&1; echo "tests consumer rc=$?" >> $R/rc.txt
n=0
for mode in layers on layers; do
  n=$((n+1))
  KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --regime churn --fetch-overlap $mode ${B_EXTRA:-}" \
    timeout ${B_RUN_S:-150} bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/$n-$mode > $R/$n-$mode.log 2>&1
  echo "$n $mode rc=$?" >> $R/rc.txt
  rm -f $R/$n-$mode/*.svg
  (cd $OUT && tar czf b-$n.tar.gz b)
done
cd $OUT && tar czf b.tar.gz b && rm -rf b
