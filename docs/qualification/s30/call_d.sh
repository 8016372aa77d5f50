#!/usr/bin/env bash
# Session 30, device call D: one lease for what calls A and B cover, most wanted first, for when
# the device budget allows one full call only (same carry as call A: .bundle-a30, lookup-bins30;
# no wheel, so gpu_serving is left out). In order, each step only while time is left (H: seconds):
#  1. issue 19: `kvq bench transfer --profile gpu --repeats 10` at the 16 MiB default, then at
#     KV_GATHER_PIPELINE_FIRST_KIB=8192 (the old default);
#  2. the GPU test session 27 changed (`every_upload_variant_lands_every_byte_of_a_scattered_fetch`:
#     one launch for 11.7 MiB at the 16 MiB default, two at 8 MiB);
#  3. the main job, `qualify --profile gpu`, every section but gpu_serving (which needs the wheel
#     and most of a call);
#  4. every GPU test binary;
#  5. issue 22: kv-lookup's bench on the 16 cores: `--only concurrent --threads 1+1,8+8,12+4
#     --seconds 2`, then `--only single`;
#  6. the two transfer runs again.
# Results in $OUT/d.tar.gz (d-first.tar.gz after each step).
set -u
H=${H:-585}
TS=$(date +%s)
R=$OUT/d; mkdir -p $R
B=.bundle-a30
L=lookup-bins30/lookup-bench-30
TR=data/traces/mooncake_conversation_trace.jsonl
el() { echo $(( $(date +%s) - TS )); }
left() { echo $(( H - $(el) )); }
snap() { (cd $OUT && tar czf d-first.tar.gz d); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; command -v ip nats-server; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
transfer() {  # transfer ROUND
  for first in default 8192; do
    [ $(left) -gt 50 ] || return
    if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
    env $env timeout 40 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$first-$1.json > $R/transfer-$first-$1.log 2>&1
    echo "transfer $first $1 rc=$? at $(el) s" >> $R/rc.txt; snap
  done
}
transfer 1
for t in $B/tests/gpu-*; do
  [ $(left) -gt 40 ] || break
  timeout 30 "$t" every_upload_variant --nocapture --test-threads=1 >> $R/gpu-test-upload.log 2>&1
  echo "$(basename $t) every_upload_variant rc=$? at $(el) s" >> $R/rc.txt
done
snap
if [ $(left) -gt 120 ]; then
  only=""
  for s in descriptor_wire reuse_settings bank_lifecycle bank_cuda_ipc transfer_oracle transfer_oracle_nixl \
           transfer_cuda_ipc trace_replay session_replay serving_smoke faults cluster; do only="$only --only $s"; done
  timeout 110 bash $B/run.sh qualify --profile gpu $only --out $R/qualify > $R/qualify.log 2>&1
  echo "qualify (all but gpu_serving) rc=$? at $(el) s" >> $R/rc.txt; snap
fi
if [ $(left) -gt 260 ]; then
  timeout 150 bash $B/run.sh tests > $R/tests.log 2>&1
  echo "tests rc=$? at $(el) s" >> $R/rc.txt; snap
fi
if [ $(left) -gt 50 ]; then
  TH=1+1; [ $(left) -gt 120 ] && TH=1+1,8+8,12+4
  timeout $(( $(left) - 10 )) $L --only concurrent --threads $TH --seconds 2 --trace $TR --json $R/concurrent-30.json > $R/concurrent-30.log 2>&1
  echo "concurrent ($TH) rc=$? at $(el) s" >> $R/rc.txt; snap
fi
if [ $(left) -gt 40 ]; then
  timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) $L --only single --trace $TR --json $R/single-30.json > $R/single-30.log 2>&1
  echo "single rc=$? at $(el) s" >> $R/rc.txt; snap
fi
transfer 2
echo "total $(el) s" >> $R/rc.txt
cd $OUT && tar czf d.tar.gz d && rm -rf d d-first.tar.gz
