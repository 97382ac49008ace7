#!/usr/bin/env bash
# One device call (twelfth session): how much could fusing the small ops of a layer into the matmuls save at
# most? Batch-1 decode of the Llama-3-8B shape (8-token bucket), one process per row (as h200_pdl_run.sh):
# the baselines, then the same steps with ops left out (benchmarks/fusion_ablation.py: timing only, the
# outputs are wrong). If int8 with norms, SiLU and residual adds all gone still takes more than bf16's step
# / 1.7, no fusion of those ops reaches issue #5's 1.7x. The kernel lists show what each ablation removed
# (and that the gate/up matmul kept its whole width under "silu"). The _fold rows ask whether a norm split
# into its row factor (computed with the residual add) and its weight (folded into the next matmuls) costs no
# kernel of its own.
# Usage on the GPU machine: bash benchmarks/h200_fusion_ablation_run.sh "$OUT" [ROW...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
declare -A VARIANT=([bf16]=bf16-b8 [int8]=int8-auto-b8 [int8_norm]=int8-auto-b8 [int8_norm_silu]=int8-auto-b8
  [int8_all]=int8-auto-b8 [bf16_all]=bf16-b8 [int8_fold]=int8-auto-b8 [bf16_fold]=bf16-b8)
declare -A ABLATE=([int8_norm]=norm [int8_norm_silu]=norm,silu [int8_all]=norm,silu,residual [bf16_all]=norm,silu,residual
  [int8_fold]=fold_norm [bf16_fold]=fold_norm)
ROWS=("$@")
[ ${#ROWS[@]} -eq 0 ] && ROWS=(bf16 int8 int8_all int8_norm int8_norm_silu bf16_all)
for r in "${ROWS[@]}"; do
  start=$(date +%s)
  timeout 100 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "${VARIANT[$r]}" --tokens 64 \
    --ablate "${ABLATE[$r]:-}" --kernel-breakdown --out "$OUT/$r" > "$OUT/$r.txt" 2>&1
  echo "== $r (${VARIANT[$r]}, ablate: ${ABLATE[$r]:-none}): exit $?, $(( $(date +%s) - start )) s"
  grep -E "ms/token|device time of one|back to back|rror" "$OUT/$r.txt" | cut -c1-200 | head -6
done
