export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 250 python3 benchmarks/sweep_moe_decode.py --out $OUT/moe_decode_sweep_h200.json --budget 200 > $OUT/sweep.log 2>&1; echo sweep rc=$?
grep best $OUT/sweep.log
timeout 300 python3 benchmarks/bench_latency.py --out $OUT/latency_quick.json --quick --budget 150 > $OUT/latency.log 2>&1; echo latency rc=$?
tail -30 $OUT/latency.log
