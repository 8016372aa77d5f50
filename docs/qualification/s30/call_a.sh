#!/usr/bin/env bash
# Session 30, device call A (issues 19 and 22), bundle of `cargo xtask gpu-bundle --with-tests` at the
# commit in .bundle-a30/build-info.json (hard links of .bundle less its wheel and pytest files: run.sh, build-info.json, data, exe,
# nixl-libs, nats-server, python, tests) and lookup-bins30/lookup-bench-30 (the stripped
# `cargo bench -p kv-lookup --bench lookup --no-run` binary of the same commit). In order:
#  1. issue 19: the GPU test session 27 changed (`every_upload_variant_lands_every_byte_of_a_
#     scattered_fetch`: one launch for 11.7 MiB at the 16 MiB default, two at 8 MiB), then
#     `kvq bench transfer --profile gpu --repeats 10` at the default and at
#     KV_GATHER_PIPELINE_FIRST_KIB=8192 (the old default), alternated twice;
#  2. every GPU test binary (`run.sh tests`);
#  3. issue 22: kv-lookup's bench on the 16 cores: `--only single`, then
#     `--only concurrent --threads 1+1,8+8,12+4 --seconds 2`.
# H: seconds the call may run. Results in $OUT/a.tar.gz (a-first.tar.gz after each step).
set -u
H=${H:-585}
TS=$(date +%s)
R=$OUT/a; mkdir -p $R
B=.bundle-a30
L=lookup-bins30/lookup-bench-30
TR=data/traces/mooncake_conversation_trace.jsonl
el() { echo $(( $(date +%s) - TS )); }
snap() { (cd $OUT && tar czf a-first.tar.gz a); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for t in $B/tests/*; do
  timeout 60 "$t" every_upload_variant --nocapture --test-threads=1 >> $R/gpu-test-upload.log 2>&1
  echo "$(basename $t) every_upload_variant rc=$? at $(el) s" >> $R/rc.txt
done
for r in 1 2; do
  for first in default 8192; do
    if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
    env $env timeout 40 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$first-$r.json > $R/transfer-$first-$r.log 2>&1
    echo "transfer $first $r rc=$? at $(el) s" >> $R/rc.txt
  done
done
snap
LEFT=$(( H - $(el) - 200 ))
if [ $LEFT -gt 60 ]; then
  timeout $(( LEFT > 240 ? 240 : LEFT )) bash $B/run.sh tests > $R/tests.log 2>&1
  echo "tests rc=$? at $(el) s" >> $R/rc.txt; snap
fi
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 30 ]; then
  timeout $(( LEFT > 70 ? 60 : LEFT - 10 )) $L --only single --trace $TR --json $R/single-30.json > $R/single-30.log 2>&1
  echo "single rc=$? at $(el) s" >> $R/rc.txt; snap
fi
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 40 ]; then
  TH=1+1; [ $LEFT -gt 110 ] && TH=1+1,8+8,12+4
  timeout $(( LEFT - 10 )) $L --only concurrent --threads $TH --seconds 2 --trace $TR --json $R/concurrent-30.json > $R/concurrent-30.log 2>&1
  echo "concurrent ($TH) rc=$? at $(el) s" >> $R/rc.txt
fi
echo "total $(el) s" >> $R/rc.txt
cd $OUT && tar czf a.tar.gz a && rm -rf a a-first.tar.gz
