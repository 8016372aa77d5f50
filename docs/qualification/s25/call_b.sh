#!/usr/bin/env bash
# Session 25, device call B (right after call A on the same lease where it is
# still warm): every GPU test binary of the final code (kv-bank's destination
# pool is now per-block states and a free bitset; the review's typed argument
# errors for dst_blocks), the wheel's GPU tests on torch, and kvq bench
# transfer --profile gpu once (issue 19's ratios). Carry .bundle (cargo xtask
# gpu-bundle --with-tests); results tarred into $OUT/b.tar.gz.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1
timeout 150 bash .bundle/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
(cd $OUT && tar czf b-1.tar.gz b)
timeout 90 bash .bundle/run.sh pytest-gpu > $R/pytest_gpu.log 2>&1; echo "pytest gpu rc=$?" >> $R/rc.txt
(cd $OUT && tar czf b-2.tar.gz b)
timeout 40 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer.json > $R/transfer.log 2>&1
echo "transfer rc=$?" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b b-1.tar.gz b-2.tar.gz
