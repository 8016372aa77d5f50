#!/usr/bin/env bash
# Session 24, device call C (whatever single GPU is lent; no H200 came for call
# A): every GPU test binary of the final code (the converting launch path now
# runs through convert_groups, and kv-bank refuses an ack before its rank wrote
# every entry: gpu_bank's tests changed with it), the wheel's GPU tests, then
# kvq bench transfer --profile gpu twice (issue 19). Carry .bundle (cargo xtask
# gpu-bundle --with-tests); results tarred into $OUT/c.tar.gz.
set -u
R=$OUT/c; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1
# Ordered by value, each step tarred, so a call cut short by the budget still returns the first ones.
timeout 150 bash .bundle/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
(cd $OUT && tar czf c-1.tar.gz c)
timeout 40 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-1.json > $R/transfer-1.log 2>&1
echo "transfer 1 rc=$?" >> $R/rc.txt
(cd $OUT && tar czf c-2.tar.gz c)
timeout 90 bash .bundle/run.sh pytest-gpu > $R/pytest_gpu.log 2>&1; echo "pytest gpu rc=$?" >> $R/rc.txt
(cd $OUT && tar czf c-3.tar.gz c)
timeout 40 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-2.json > $R/transfer-2.log 2>&1
echo "transfer 2 rc=$?" >> $R/rc.txt
cd $OUT && tar czf c.tar.gz c && rm -rf c
