#!/usr/bin/env bash
# Session 32: the CUDA-after-fork guards on a GPU (never run on one before) and the GPU tests of
# the code they changed. gpu-fork32/ holds stripped release test binaries of main at 63fe1ad
# (`cargo test --release --no-run`): kv-transfer's gpu_fork (a child forked after the CUDA copy
# backend was used: its copy refused naming both pids, its drops return, the parent copies every
# byte again), gpu and gpu_layouts (the copy backend whose devices and events are now held by
# ProcessBound, every layout checked byte by byte), kv-bank's gpu_bank and gpu_ipc (CUDA banks,
# whose driver record now goes through cuda_usable_here). NIXL libraries from the first carried
# bundle folder that has them (B=.bundle-t by default). Results in $OUT/$NAME.tar.gz, NAME=${NAME:-g}.
set -u
NAME=${NAME:-g}
R=$OUT/$NAME; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; } > $R/machine.txt 2>&1
B=${B:-.bundle-t}
if [ -f $B/nixl-libs.tar.gz ]; then
  mkdir -p /tmp/nixl && tar xzf $B/nixl-libs.tar.gz -C /tmp/nixl
  export LD_LIBRARY_PATH="/tmp/nixl/.nixl_cu13.mesonpy.libs:/tmp/nixl/nixl_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NIXL_PLUGIN_DIR=/tmp/nixl/.nixl_cu13.mesonpy.libs/plugins KV_NIXL_LIB_DIR=/tmp/nixl/.nixl_cu13.mesonpy.libs
fi
for t in gpu_fork gpu_bank gpu_ipc gpu_layouts gpu; do
  timeout ${T:-120} gpu-fork32/$t --test-threads=1 > $R/$t.log 2>&1
  echo "$t rc=$? $(grep -E '^test result' $R/$t.log | tail -1)" >> $R/rc.txt
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
