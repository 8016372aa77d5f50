#!/usr/bin/env bash
# Session 21, device call G (planned for one H200, run on one H100: its 16 cores; right after F on the same
# lease): kv-lookup's concurrent rows with the bench binaries before
# (dcebd6e) and after (d98feb0) the combined event writers, and with the run
# skip (lookup-bench-skip) when it was built, one run each (session 20's call
# E cut to one alternation); then the wheel's tiny serving runs on the real
# machine (pytest-gpu, all of test_harness.py: the one-way stage
# request through real worker processes, on CPU and CUDA). Carry .bundle,
# lookup-bins and data/traces/mooncake_conversation_trace.jsonl; results are
# tarred into $OUT/g.tar.gz.
set -u
R=$OUT/g; mkdir -p $R
nproc > $R/nproc.txt
for v in before after skip; do
  bin=lookup-bins/lookup-bench; [ $v = before ] && bin=lookup-bins/lookup-bench-before
  [ $v = skip ] && bin=lookup-bins/lookup-bench-skip
  [ -x $bin ] || continue
  timeout 130 $bin --only concurrent --threads 1+1,4+4,8+8,12+4 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/lookup-$v.json > $R/lookup-$v.log 2>&1
  echo "lookup $v rc=$?" >> $R/rc.txt
done
(cd .bundle && timeout 200 bash run.sh pytest-gpu $PWD/../crates/kv-testkit/python/tests/test_harness.py) \
  > $R/pytest.log 2>&1; echo "pytest rc=$?" >> $R/rc.txt
cd $OUT && tar czf g.tar.gz g && rm -rf g
