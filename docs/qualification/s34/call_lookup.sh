#!/usr/bin/env bash
# Session 34, issue 22: what in our own event thread costs the same-index lookups (CPU only, the
# lent machine's 16 cores). `--only interference --threads 1+1` now splits the same-index row
# into publications that change no entry (Publish::NoChange) and the same events batched 64 per
# publication. Binary: lookup-bins34/lookup-bench, `cargo bench -p kv-lookup --bench lookup
# --no-run` of this commit with line tables, `objcopy --strip-debug` (symbols kept for perf).
# lookup-bins34/perfkit.tgz: this build machine's perf 6.1 with its libraries, run through its own
# loader, to see whether the lent machine allows a profile (and hardware counters).
# Results in $OUT/$NAME.tar.gz, NAME=${NAME:-x}.
set -u
NAME=${NAME:-x}
R=$OUT/$NAME; mkdir -p $R
B=lookup-bins34/lookup-bench
{ nproc; lscpu | grep -E "Model name|L2|L3|Thread|Core|Socket"; cat /sys/kernel/mm/transparent_hugepage/enabled;
  cat /sys/devices/system/clocksource/clocksource0/current_clocksource;
  echo "perf_event_paranoid $(cat /proc/sys/kernel/perf_event_paranoid)"; id; } > $R/machine.txt 2>&1
tar xzf lookup-bins34/perfkit.tgz -C /tmp
PERF="/tmp/perfkit/lib/ld-linux-x86-64.so.2 --library-path /tmp/perfkit/lib /tmp/perfkit/perf"
$PERF stat -e cycles,instructions,L1-dcache-load-misses,LLC-load-misses -- sleep 0.1 > $R/perf-probe.txt 2>&1
echo "probe rc=$?" >> $R/perf-probe.txt
for run in 1 2; do
  timeout ${T:-150} $B --only interference --threads 1+1 --seconds 3 > $R/interference-$run.log 2>&1
  echo "interference-$run rc=$?" >> $R/rc.txt
done
# One more run under the profiler: hardware cycles when the probe counted them, else cpu-clock.
EV=cpu-clock; grep -q "[0-9] *cycles" $R/perf-probe.txt && EV=cycles
timeout ${T:-150} $PERF record -F 1999 -e $EV -o /tmp/perf.data $B --only interference --threads 1+1 \
  --seconds 3 > $R/interference-perf.log 2> $R/perf-record.err
echo "perf record ($EV) rc=$?" >> $R/rc.txt
$PERF report -i /tmp/perf.data --no-children --sort pid,sym --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" \
  | head -400 > $R/perf-by-thread.txt
$PERF script -i /tmp/perf.data -F tid,ip,sym 2>/dev/null | gzip > $R/perf-script.txt.gz
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
