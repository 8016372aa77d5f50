#!/usr/bin/env bash
# Session 25, device call B (every GPU test binary already ran in call A's
# time left): the wheel's GPU tests on torch (the review's typed argument
# errors for dst_blocks, the destination pool's new representation under a
# CUDA target), and kvq bench transfer --profile gpu once more (issue 19). Carry .bundle (cargo xtask
# gpu-bundle --with-tests); results tarred into $OUT/b.tar.gz.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1
timeout 90 bash .bundle/run.sh pytest-gpu > $R/pytest_gpu.log 2>&1; echo "pytest gpu rc=$?" >> $R/rc.txt
(cd $OUT && tar czf b-2.tar.gz b)
timeout 40 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer.json > $R/transfer.log 2>&1
echo "transfer rc=$?" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b b-2.tar.gz
