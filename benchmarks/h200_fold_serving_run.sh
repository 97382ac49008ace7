#!/usr/bin/env bash
# One device call (twelfth session): the folded-norm rows of the fusion ablation, then the int8 serving
# comparison prepared in the eleventh session (h200_int8_serving_run.sh).
# Usage on the GPU machine: bash benchmarks/h200_fold_serving_run.sh "$OUT"
bash "$(dirname "$0")/h200_fusion_ablation_run.sh" "$1" int8_fold bf16_fold
bash "$(dirname "$0")/h200_int8_serving_run.sh" "$1"
