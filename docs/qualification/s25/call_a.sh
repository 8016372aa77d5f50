#!/usr/bin/env bash
# Session 25, device call A (one H200, asked with needs_h200: the full workload's
# two regimes at 8 sessions do not fit an 80 GB card, session 23 call A):
# (1) every GPU test binary (the layered consumer is new) and the wheel's gate
# tests on torch; (2) gpu_serving, the issue-21 workload (8 sessions x 6 turns
# to 32K) in both regimes with the whole-fetch gate (--fetch-overlap on, the
# default), advise busy poll on at both ends as in every serving record since
# session 18; (3) kvq bench transfer --profile gpu twice (issue 19's ratios,
# unmeasured on an H200 since session 19). Carry .bundle (cargo xtask
# gpu-bundle --with-tests); results are tarred into $OUT/a.tar.gz
# (a-first.tar.gz after the serving run, in case the rest runs past the limit).
set -u
R=$OUT/a; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name"; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
timeout 150 bash .bundle/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
timeout 60 bash .bundle/run.sh pytest-gpu test_gpu.py -k gate > $R/pytest_gate.log 2>&1; echo "pytest gate rc=$?" >> $R/rc.txt
( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done ) > $R/memory_used_mib.txt 2>&1 &
MON=$!
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
REGIME=churn; [ "${MIB:-0}" -gt 100000 ] && REGIME=both
echo "memory.total ${MIB} MiB: --regime $REGIME" >> $R/rc.txt
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --regime $REGIME" \
  timeout 280 bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
echo "serving rc=$?" >> $R/rc.txt
kill $MON
rm -f $R/serving/*.svg
(cd $OUT && tar czf a-first.tar.gz a)
for i in 1 2; do
  timeout 40 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$i.json > $R/transfer-$i.log 2>&1
  echo "transfer $i rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf a.tar.gz a && rm -rf a
