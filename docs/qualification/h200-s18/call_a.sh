#!/usr/bin/env bash
# Session 18, device call A (one H200): host facts, a GPU clock log, worker_forward
# (forward jitter stages and a 40-rep long_run), gpu_serving (GPU profile) and
# the transfer bench. Run from the checkout root with the bundle carried as
# .bundle/; writes $OUT/a/.
set -u
R=$OUT/a; mkdir -p $R
(nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 500 > $R/gpu_clocks.csv 2>&1 &)
{ grep MHz /proc/cpuinfo | sort | uniq -c | head; ls /sys/devices/system/cpu/cpu0/cpufreq 2>&1
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1
  ls /sys/devices/system/cpu/cpu0/cpuidle 2>&1; cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1
  systemd-detect-virt 2>&1; grep -m1 -o hypervisor /proc/cpuinfo; nproc; uptime; nvidia-smi -q -d CLOCK | head -40; } > $R/host.txt 2>&1
export PYTHONPATH=$PWD/.bundle/python
bash .bundle/run.sh --help > /dev/null 2>&1   # unpacks the bundle once
timeout 290 bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
timeout 70 bash .bundle/run.sh bench transfer --profile gpu --repeats 5 --json $R/transfer.json > $R/transfer.log 2>&1
timeout 100 python3 xtask/gpu/worker_forward.py $R/wf --reps 5 > $R/wf.log 2>&1
pkill nvidia-smi
du -sh $R
