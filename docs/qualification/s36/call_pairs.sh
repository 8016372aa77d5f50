#!/usr/bin/env bash
# Session 36, issue 22: the interference rows as paired rounds (`--rounds`, lookup bench of
# 38b1a40: each row R pairs of a lone run and a loaded run, back to back, median loss), main
# against the copy-on-write branch, on the lent machine's 16 cores (CPU only). Binaries
# (carried, ignored dir lookup-bins36/), `cargo bench -p kv-lookup --bench lookup --no-run`,
# `objcopy --strip-debug`, each with its own target dir:
#   lookup-main: main at 38b1a40;
#   lookup-cow:  branch cow36 = cow35 (cb7759b) + the same bench commit (f3ea0f1).
# Alternated main, cow, main, cow while H seconds allow another pass (about 150 s each).
# Call: run(command="H=560 NAME=r bash docs/qualification/s36/call_pairs.sh", carry=["lookup-bins36"]).
set -u
H=${H:-560}
NAME=${NAME:-r}
TS=$(date +%s)
R=$OUT/$NAME; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L2|L3|Thread|Core|Socket"; } > $R/machine.txt 2>&1
left() { echo $(( H - ($(date +%s) - TS) )); }
for pass in 1 2; do
  for b in main cow; do
    [ "$(left)" -gt 190 ] || break 2
    timeout 180 lookup-bins36/lookup-$b --only interference --threads 1+1 --seconds 1 --rounds 5 \
      > $R/pairs-$b-$pass.log 2>&1
    echo "pairs-$b-$pass rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
