#!/usr/bin/env bash
# Session 26, device call A. Carry .bundle-c (.bundle less its test binaries and pytest wheels, to fit the carry) (cargo xtask gpu-bundle --with-tests at
# 6ec9d8b, main's HEAD at the session start); results in $OUT/a.tar.gz.
# On an H200: kvq bench transfer --profile gpu twice (issue 19's H200 ratios of
# the current code), then gpu_serving with the issue-21 workload in the time left.
# On an H100: every GPU test binary (the slot-table LRU of bf727d8 was tested on
# the CPU only), the wheel's GPU tests, then the transfer bench twice.
set -u
TS=$(date +%s)
R=$OUT/a; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name"; } > $R/machine.txt 2>&1
bash .bundle-c/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
transfer() {
  timeout 45 bash .bundle-c/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$1.json > $R/transfer-$1.log 2>&1
  echo "transfer $1 rc=$?" >> $R/rc.txt
}
if grep -q H200 $R/machine.txt; then
  transfer 1; transfer 2
  (cd $OUT && tar czf a-first.tar.gz a)
  LEFT=$(( 590 - ( $(date +%s) - TS ) ))
  KVQ_GPU_SERVING_TIMEOUT_S=$((LEFT - 25)) KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --budget-s $((LEFT - 80))" \
    timeout $((LEFT - 10)) bash .bundle-c/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
  echo "serving rc=$?" >> $R/rc.txt
else
  timeout 300 bash .bundle-c/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
  (cd $OUT && tar czf a-first.tar.gz a)
  timeout 90 bash .bundle-c/run.sh pytest-gpu > $R/pytest_gpu.log 2>&1; echo "pytest gpu rc=$?" >> $R/rc.txt
  (cd $OUT && tar czf a-first.tar.gz a)
  transfer 1; transfer 2
fi
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf a.tar.gz a && rm -rf a a-first.tar.gz
