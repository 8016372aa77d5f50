#!/usr/bin/env bash
# Session 21, device call F (planned for one H200; run on one H100, see COMMANDS.md): gpu_serving with ON's prompt staged
# ahead of the advise (--stage-prompt on, new this session; off by default
# after this call) and without (--stage-prompt off), on one machine lease, the advise
# busy poll on at both ends as in session 19's call C. The first-turn goal
# (ON - OFF <= 1 ms) is judged per run on paired turns, so the two runs are
# compared through their own paired medians. Carry .bundle; results are tarred
# into $OUT/f.tar.gz (the device tool returns few files).
# F_EXTRA: more harness arguments; on the H100 (80 GB) "--regime churn" still
# ran out of memory, "--regime churn --sessions 4" fit (COMMANDS.md).
set -u
R=$OUT/f; mkdir -p $R
for v in on off; do
  KVQ_GPU_SERVING_ARGS="--stage-prompt $v --advise-busy-poll-us 1000000 --budget-s 230 ${F_EXTRA:-}" \
    timeout 290 bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/st-$v > $R/st-$v.log 2>&1
  echo "stage=$v rc=$?" >> $R/rc.txt
  rm -f $R/st-$v/*.svg
done
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $R/gpu.txt 2>&1
cd $OUT && tar czf f.tar.gz f && rm -rf f
