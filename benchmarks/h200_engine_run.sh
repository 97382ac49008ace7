#!/usr/bin/env bash
# One device call: engine correctness with the Pallas kernels, then the Llama-3-8B-shaped
# engine benchmarks (bf16 throughput + batch-1 latency, int8 batch-1 latency).
# Usage on the GPU machine: bash benchmarks/h200_engine_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
# The package maps models/, sharding/, ... to jlight.* (pyproject package-dir): install it, offline.
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# 1. Greedy outputs with the Pallas kernels (auto on GPU) equal transformers' on tiny float32 models.
timeout 170 python3 -m pytest -x -q -p no:cacheprovider tests/test_engine.py -k "batched or preemption" 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
# 2. bf16 Llama-3-8B shape: batch-1 latency, then the nano-vllm workload.
timeout 260 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 512 --out "$OUT" 2>&1 | grep -v "^compiling" | tee "$OUT/bf16.txt"
# 3. int8 weights: batch-1 latency only (two small buckets keep the compile short).
timeout 120 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --quantization int8 \
  --num-requests 0 --max-num-seqs 4 --max-num-batched-tokens 16 --out "$OUT" 2>&1 | tee "$OUT/int8.txt"
