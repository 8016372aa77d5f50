#!/usr/bin/env bash
# Session 28, device call A (issue 19): the bundle of `cargo xtask gpu-bundle --with-tests` at
# b1fa715 (build-info says dirty: call_b.sh was not committed yet; no source differed).
# First the GPU test that session 27 changed (`every_upload_variant_lands_every_byte_of_a_
# scattered_fetch`: one launch for an 11.7 MiB fetch at the 16 MiB default, two at an explicit
# 8 MiB), then `kvq bench transfer --profile gpu --repeats 10` at the default and at
# KV_GATHER_PIPELINE_FIRST_KIB=8192 (the old default), alternated three times, then every GPU
# test binary; then kv-lookup's bench on the 16 cores (issue 22; lookup-bins28/lookup-bench-main28,
# the stripped `cargo bench -p kv-lookup --bench lookup --no-run` binary of fea24b0): `--only single`
# twice, then `--only concurrent --threads 1+1,8+8,12+4 --seconds 2`. Carry .bundle-a28 (hard links of .bundle's run.sh, build-info.json, data, exe,
# nixl-libs, tests). Results in $OUT/a.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/a; mkdir -p $R
B=.bundle-a28
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for t in $B/tests/gpu-*; do
  timeout 60 "$t" every_upload_variant --nocapture --test-threads=1 >> $R/gpu-test-upload.log 2>&1
  echo "$(basename $t) every_upload_variant rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done
for r in 1 2 3; do
  for first in default 8192; do
    if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
    env $env timeout 40 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$first-$r.json > $R/transfer-$first-$r.log 2>&1
    echo "transfer $first $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
done
(cd $OUT && tar czf a-first.tar.gz a)
timeout 240 bash $B/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
L=lookup-bins28/lookup-bench-main28
TR=data/traces/mooncake_conversation_trace.jsonl
for r in 1 2; do
  timeout 60 $L --only single --trace $TR --json $R/single-main28-$r.json > $R/single-main28-$r.log 2>&1
  echo "single main28 $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done
timeout 170 $L --only concurrent --threads 1+1,8+8,12+4 --seconds 2 --trace $TR --json $R/concurrent-main28.json > $R/concurrent-main28.log 2>&1
echo "concurrent main28 rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf a.tar.gz a && rm -rf a a-first.tar.gz
