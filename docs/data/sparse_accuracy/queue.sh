#!/bin/bash
# Runs each line of QUEUE_FILE ("NAME key=value ...") with run.py into runs/sa/NAME, one at a time;
# appends "NAME {summary json}" to docs/data/sparse_accuracy/results.txt. Lines already done are skipped.
cd "$(dirname "$0")/../../.."
while read -r name args; do
  [ -z "$name" ] && continue
  grep -q "^$name " docs/data/sparse_accuracy/results.txt 2>/dev/null && continue
  start=$(date +%s)
  out=$(.venv/bin/python docs/data/sparse_accuracy/run.py runs/sa/$name $args 2>runs/sa/$name.err | tail -1)
  echo "$name $out $(( $(date +%s) - start ))s" >> docs/data/sparse_accuracy/results.txt
done < "$1"
