#!/usr/bin/env bash
# Session 28, device call C: calls A and B in one 600 s call, most wanted first (the device tool
# refused four starts, so one lease may be all there is). Bundle: `cargo xtask gpu-bundle
# --with-tests` at b1fa715 (build-info says dirty: call_b.sh was not committed yet; no source
# differed), carried as .bundle-c28 (.bundle less its pytest files), and lookup-bins28.
#  1. issue 19: the GPU test session 27 changed (`every_upload_variant_lands_every_byte_of_a_
#     scattered_fetch`: one launch for 11.7 MiB at the 16 MiB default, two at 8 MiB), then
#     `kvq bench transfer --profile gpu --repeats 10` at the default and at 8 MiB, alternated twice;
#  2. the main job, `qualify --profile gpu`, every section (gpu_serving: its GPU workload with the
#     advise busy poll and a turn budget that fits the call);
#  3. every GPU test binary;
#  4. issue 22: kv-lookup's bench on the 16 cores (`--only single`, then `--only concurrent
#     --threads 1+1,8+8,12+4 --seconds 2`), as far as the time goes.
# Results in $OUT/c.tar.gz (c-first.tar.gz after each step, in case the call is cut).
set -u
# H: seconds this call may run (585 for a full 600 s call; less when the device budget is short).
H=${H:-585}
TS=$(date +%s)
R=$OUT/c; mkdir -p $R
B=.bundle-c28
el() { echo $(( $(date +%s) - TS )); }
snap() { (cd $OUT && tar czf c-first.tar.gz c); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; command -v ip nats-server; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for t in $B/tests/gpu-*; do
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
Q=$(( H - $(el) - 15 )); [ $Q -gt 480 ] && Q=480
KVQ_GPU_SERVING_TIMEOUT_S=$(( Q - 70 )) KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --budget-s $(( Q - 140 ))" \
  timeout $Q bash $B/run.sh qualify --profile gpu --out $R/qualify > $R/qualify.log 2>&1
echo "qualify rc=$? at $(el) s" >> $R/rc.txt
snap
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 40 ]; then
  timeout $(( LEFT > 120 ? 90 : LEFT - 20 )) bash $B/run.sh tests > $R/tests.log 2>&1
  echo "tests rc=$? at $(el) s" >> $R/rc.txt; snap
fi
L=lookup-bins28/lookup-bench-main28
TR=data/traces/mooncake_conversation_trace.jsonl
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 30 ]; then
  timeout $(( LEFT - 10 )) $L --only single --trace $TR --json $R/single-main28.json > $R/single-main28.log 2>&1
  echo "single main28 rc=$? at $(el) s" >> $R/rc.txt; snap
fi
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 40 ]; then
  TH=1+1; [ $LEFT -gt 110 ] && TH=1+1,8+8,12+4
  timeout $(( LEFT - 10 )) $L --only concurrent --threads $TH --seconds 2 --trace $TR --json $R/concurrent-main28.json > $R/concurrent-main28.log 2>&1
  echo "concurrent main28 ($TH) rc=$? at $(el) s" >> $R/rc.txt
fi
echo "total $(el) s" >> $R/rc.txt
cd $OUT && tar czf c.tar.gz c && rm -rf c c-first.tar.gz
