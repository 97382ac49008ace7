#!/usr/bin/env bash
# Device call (2026-12-02, sixteenth session): the first GPU run after the fifteenth session's sampler
# change (structured outputs: a guide mask and a lax.cond in every step), which ran on CPUs only.
# 1. the engine's tests on the GPU (tiny random models against transformers, default GPU kernels);
# 2. structured outputs on the GPU (a tiny random Llama, llguidance carried in .whl);
# 3. batch-1 decode of the Llama-3-8B shape, bf16 and int8, each in its own process (the 1.7x target);
# 4. the phases kernel with deeper weight prefetch across its barriers (matmul_chain.py, 16 layers).
# Usage on the GPU machine (carry .whl): bash benchmarks/h200_recheck16_run.sh "$OUT" [PART...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests structured decode chain)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
for part in "${PARTS[@]}"; do case $part in
tests)
  run pytest_gpu 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_kernels_attention.py ;;
structured)
  tiny=$(python3 -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import make_tiny_model; print(make_tiny_model('/tmp/tiny', 'LlamaForCausalLM'))" 2>/dev/null | tail -1)
  run structured 150 python3 benchmarks/structured_output.py --model "$tiny" --num-requests 32 --max-tokens 48 \
    --mask-rows 1 32 --out "$OUT/structured" ;;
decode)
  for v in bf16-b8 int8-auto-b8; do
    run "decode_$v" 150 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 96 \
      --kernel-breakdown --out "$OUT/decode_$v"
  done ;;
chain)
  for v in xla-int8 mosaic-i8-layer mosaic-i8-layer-st8 mosaic-i8-layer-st10 mosaic-i8-layer-st10-s2 \
      mosaic-i8-layer-st10-nobarrier; do
    run "chain_$v" 90 python3 benchmarks/matmul_chain.py --variants "$v" --layers 16 --out "$OUT/chain_$v"
  done ;;
esac; done
# Everything under $OUT in one archive: a call brings back at most 8 files.
(cd "$OUT" && tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .)
