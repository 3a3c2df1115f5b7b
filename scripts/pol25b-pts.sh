#!/bin/bash
# Issue 25 fourth round, experiment only: one adaptive run per failing matrix point.
# usage: scripts/pol25b-pts.sh TAG [points...]; env knobs passed through
cd "$(dirname "$0")/.."; R=${OUT:-/tmp/pol25b-runs}; mkdir -p "$R"
B=./target/release/kvtier
T="--trace traces/conversation_trace.jsonl --no-l3"
S="--trace traces/synthetic_trace.jsonl --no-l3"
declare -A P=(
 [T10]="$T --device-pages 2048 --host-pages 8192 6.59"
 [T20]="$T --device-pages 4096 --host-pages 16384 8.21"
 [T40]="$T --device-pages 8192 --host-pages 32768 13.13"
 [S10]="$S --device-pages 2048 --host-pages 8192 9.88"
 [S20]="$S --device-pages 4096 --host-pages 16384 16.40"
 [S40]="$S --device-pages 8192 --host-pages 32768 26.31"
 [C1]="--no-l3 --device-pages 256 --host-pages 1024 47.19"
 [C2]="--no-l3 --device-pages 512 --host-pages 2048 57.28"
 [C5]="--no-l3 --device-pages 1024 --host-pages 4096 74.61"
 [L2]="--clients 100 --rounds 32 --no-l3 --device-pages 512 --host-pages 2048 28.27"
 [L5]="--clients 100 --rounds 32 --no-l3 --device-pages 1024 --host-pages 4096 43.82"
 [I2]="--instances 2 --device-pages 256 --host-pages 1024 --l3-pages 8192 52.37"
 [I5]="--instances 2 --device-pages 512 --host-pages 2048 --l3-pages 8192 78.55"
 [I10]="--instances 2 --device-pages 1024 --host-pages 4096 --l3-pages 8192 81.42"
)
tag=$1; shift
for p in "$@"; do
  a=(${P[$p]}); best=${a[-1]}; unset 'a[-1]'
  nice $B sim --no-compare --eviction adaptive --host-admission adaptive:256 "${a[@]}" --json > $R/$tag-$p.json 2>/dev/null
  python3 -c "
import json,sys;d=json.load(open('$R/$tag-$p.json'));h=d['hits']['total']*100
ad=d['adaptive'][0]
print('$tag $p %.2f vs best %s: %+.2f  dl=%d gate=%s rem=%s reu=%s ttft=%.0f/%.0f'%(h,$best,h-$best,ad['depth_limit'],ad['depth_gate'],ad['cls_removed'],ad['cls_reused'],d['ttft_ms']['p50'],d['ttft_ms']['p99']))"
done
