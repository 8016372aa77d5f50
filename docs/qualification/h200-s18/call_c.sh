#!/usr/bin/env bash
# Session 19, device call C (one H200): is the ~0.8 ms between the router's own
# advise time (~0.1 ms) and the client-observed advise_ms the wake-up of idle
# threads on this VM? advise_latency.py (back to back and paced 20 ms apart)
# without busy polling, with the router spinning after each answer, and with
# router and client both spinning; then gpu_serving with both spinning
# (--advise-busy-poll-us 1000000: the router spins up to 1 s after an answer,
# the client until its reply), to compare with call A's advise_ms, first turns
# and ON/ideal; then the harness's tiny service test on this machine (torch).
# Carry .bundle; results are tarred into $OUT/c.tar.gz.
set -u
R=$OUT/c; mkdir -p $R
bash .bundle/run.sh --help > /dev/null 2>&1   # unpacks the bundle once
export PYTHONPATH=$PWD/.bundle/python KVQ_ROUTER_BIN=$PWD/.bundle/exe/kv-reuse-router \
  KV_NATS_SERVER=$PWD/.bundle/bin/nats-server BLOCKS=512
A=docs/qualification/cpu-s14-advise/advise_latency.py
timeout 60 python3 $A > $R/advise-none.log 2>&1; echo "none rc=$?" >> $R/rc.txt
timeout 60 python3 $A --advise-busy-poll-us 1000000 > $R/advise-router.log 2>&1; echo "router rc=$?" >> $R/rc.txt
CLIENT_BUSY_POLL_US=1000000 timeout 60 python3 $A --advise-busy-poll-us 1000000 > $R/advise-both.log 2>&1
echo "both rc=$?" >> $R/rc.txt
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000" timeout 300 bash .bundle/run.sh qualify --profile gpu \
  --only gpu_serving --out $R/serving > $R/serving.log 2>&1; echo "serving rc=$?" >> $R/rc.txt
rm -f $R/serving/*.svg
(cd .bundle && timeout 120 bash run.sh pytest-gpu $PWD/../crates/kv-testkit/python/tests/test_harness.py \
  -k "router_service") > $R/pytest_service.log 2>&1; echo "pytest rc=$?" >> $R/rc.txt
cd $OUT && tar czf c.tar.gz c && rm -rf c
