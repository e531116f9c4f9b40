#!/usr/bin/env bash
# SpecBench on a GPU, bf16, the bundled pair, batch 1-32: every method side by side in one process,
# and every output checked against plain batch-1 decoding of its prompt.
#
# UNMEASURED: written on a machine without a GPU and never run there. It uses only options the CPU
# tests exercise (bench --suite/--device/--dtype/--methods/--costs/--json), but the CUDA path itself
# (bf16 forwards, the calibration's synchronised timings) is untested.
#
# Fails (exit 1) when a method could not run or the audit finds a synchronization error in any
# output. bf16 batch effects can flip near-ties: those are reported as fp ties and pass, unless
# STRICT=1, which requires every output to be token-identical to plain decoding.
#
#   make setup && scripts/gpu_bench.sh                  # 10 prompts per task group, 128 new tokens
#   PER_CATEGORY=80 scripts/gpu_bench.sh                # the whole suite (480 prompts): hours
#   METHODS=ar+continuous,ragged BATCHES=1,8 scripts/gpu_bench.sh
set -euo pipefail

BIN=${BIN:-.venv/bin}
OUT=${OUT:-runs/gpu_bench}
DEVICE=${DEVICE:-cuda}
PER_CATEGORY=${PER_CATEGORY:-10}
MAX_NEW=${MAX_NEW:-128}
BATCHES=${BATCHES:-1,2,4,8,16,32}
# ragged speculates adaptively by default (`+fixed`: K every round); ar+continuous is plain decoding batched
# as ragged batches, the baseline of the paired ratios
METHODS=${METHODS:-ar,ar+continuous,ragged+k1+fixed,ragged+k3+fixed,ragged+fixed,ragged,ragged+ngram+fixed,ragged+ngram,ragged+hybrid,eqspec,exspec}
STRICT=${STRICT:-0}

mkdir -p "$OUT"
"$BIN/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"

# --recalibrate: measure this GPU's cost model now (the cache may hold another machine's or a busy one's)
"$BIN/batchspec" bench --suite specbench --per-category "$PER_CATEGORY" --max-new-tokens "$MAX_NEW" \
    --device "$DEVICE" --dtype bfloat16 --draft-dtype bfloat16 \
    --batch-sizes "$BATCHES" --methods "$METHODS" --num-draft-tokens 5 \
    --costs --recalibrate \
    --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plots "$OUT/plots" | tee "$OUT/bench.txt"

STRICT="$STRICT" "$BIN/python" - "$OUT/bench.json" <<'PY'
import json, os, sys

report = json.load(open(sys.argv[1]))
strict = os.environ["STRICT"] == "1"
bad = []
for m in report["methods"]:
    if m["error"] is not None:
        bad.append(f"{m['method']}: could not run: {m['error']}")
        continue
    exact = f"{m['exact_matches']}/{m['prompts'] - m['errors']}"
    print(f"{m['method']:<40} exact {exact:>9}  fp ties {m['fp_ties']:>3}  sync errors {m['sync_errors']:>3}"
          f"  tok/s {m['tokens_per_s']}")
    if m["errors"]:
        bad.append(f"{m['method']}: {m['errors']} prompts refused")
    if m["sync_errors"]:
        bad.append(f"{m['method']}: {m['sync_errors']} synchronization errors")
    if strict and m["exact_match"] != 1.0:
        bad.append(f"{m['method']}: {exact} token-identical to plain decoding (STRICT=1)")
if bad:
    print("\n".join(["FAILED:"] + bad), file=sys.stderr)
    sys.exit(1)
print("every method reproduced plain decoding" + (" token for token" if strict else " (up to fp ties)"))
PY
