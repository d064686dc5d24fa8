#!/usr/bin/env bash
# GPU figures and the CUDA-only paths CI cannot reach (CI has no GPU).
#
#   benchmarks/gpu.sh [OUT_DIR]          # default OUT_DIR: runs/gpu-bench
#
# On a machine with at least one CUDA GPU it runs, each as a normal `shardwise train` job:
#   1. lab preset (6 layers, 384 wide, context 256), one GPU, bf16-mixed + torch.compile
#   2. a GPT-2 124M-shaped model (12 layers, 12 heads, 768 wide, context 1024, vocab 50304),
#      one GPU, bf16-mixed + torch.compile
#   3. NCCL: ddp and fsdp on 2 GPUs when there are 2 or more, else fsdp on 1 GPU (one NCCL rank)
#   4. fsdp-offload: FSDP2 CPUOffloadPolicy with pinned host memory
#   5. the profiler with a CUDA memory snapshot (the pickle pytorch.org/memory_viz opens)
#   6. shardwise rehearse --device cuda: rank 0 of llama-3-8b on 8 GPUs (fsdp) played on this one GPU
# and prints tokens/s, MFU, peak memory per rank for each. Every step runs even when an earlier one
# fails; the script exits 1 if any step failed (each failure is named at the end), 77 when there is
# no GPU at all (the automake "skipped" code: nothing was measured), 0 only when everything passed.
#
# Knobs (environment): STEPS (default 200), PYTHON (default .venv/bin/python next to this repo);
# GPU_SH_FORCE_CPU=1 runs the steps on the CPU anyway, to check the script itself (no figures:
# bf16/compile/offload behave differently there and the memory snapshot step must fail).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-runs/gpu-bench}"
STEPS="${STEPS:-200}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)"
if [[ -z "$NGPU" ]]; then
    echo "gpu.sh: cannot import torch with $PY; run scripts/bootstrap first (or set PYTHON=...)." >&2
    exit 1
fi
if [[ "$NGPU" == "0" && "${GPU_SH_FORCE_CPU:-0}" == "1" ]]; then
    echo "gpu.sh: GPU_SH_FORCE_CPU=1: running on the CPU to check the script; the figures mean nothing." >&2
    NGPU=1
elif [[ "$NGPU" == "0" ]]; then
    echo "gpu.sh: NO GPU on this machine (torch.cuda.is_available() is False): nothing was measured." >&2
    echo "gpu.sh: run it on a machine with a CUDA GPU; CPU figures come from 'shardwise bench'." >&2
    exit 77
fi

mkdir -p "$OUT"
FAILED=()
COMMON=(--set train.steps="$STEPS" --set train.sample_tokens=0 --set train.progress=false
        --set checkpoint.at_end=false --set train.eval_every=0 --set train.eval_batches=5)
GPT2=(--set model.overrides.n_layer=12 --set model.overrides.n_head=12 --set model.overrides.n_embd=768
      --set model.overrides.block_size=1024 --set model.overrides.vocab_size=50304
      --set train.micro_batch_size=8)

report() {  # report NAME RUN_DIR: the figures of one finished run
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
name, run = sys.argv[1], sys.argv[2]
s = json.load(open(f"{run}/summary.json"))
ranks = (s.get("memory") or {}).get("ranks") or []
peak = max((r.get("peak_bytes") or 0) for r in ranks) / 2**30 if ranks else float("nan")
# MFU / FLOP fields, whatever their exact names (the trainer's throughput fields).
extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in s.items() if any(w in k for w in ("mfu", "flop")))
print(f"== {name}: {s['strategy']} x{s['world_size']} {s.get('precision')} | {s['tokens_per_s']:,.0f} tokens/s | "
      f"step {s['step_time_s'] * 1e3:.1f} ms | peak {peak:.2f} GiB/rank | {extra or 'no MFU field'} | "
      f"final loss {s['final_train_loss']:.4f}")
EOF
}

step() {  # step NAME -- shardwise train arguments...
    local name="$1"; shift; shift
    local run="$OUT/$name"
    rm -f "$run/summary.json"
    echo "gpu.sh: $name ..." >&2
    if ! "$PY" -m shardwise train "$@" --out "$run" "${COMMON[@]}"; then
        echo "gpu.sh: FAILED: $name (see the output above; run dir $run)" >&2
        FAILED+=("$name")
        return 1
    fi
    if [[ ! -f "$run/summary.json" ]]; then
        echo "gpu.sh: FAILED: $name wrote no summary.json" >&2
        FAILED+=("$name")
        return 1
    fi
    report "$name" "$run" || FAILED+=("$name (report)")
}

"$PY" -m shardwise env
BF16_COMPILE=(--set parallel.precision=bf16-mixed --set train.compile=true)
step lab-bf16-compile -- --nproc 1 --strategy single --set model.preset=lab "${BF16_COMPILE[@]}"
step gpt2-124m-bf16-compile -- --nproc 1 --strategy single --set model.preset=lab "${GPT2[@]}" "${BF16_COMPILE[@]}"
if (( NGPU >= 2 )); then
    step nccl-ddp-2gpu -- --nproc 2 --strategy ddp --set model.preset=lab
    step nccl-fsdp-2gpu -- --nproc 2 --strategy fsdp --set model.preset=lab
    OFFLOAD_NPROC=2
else
    step nccl-fsdp-1gpu -- --nproc 1 --strategy fsdp --set model.preset=lab
    OFFLOAD_NPROC=1
fi
step fsdp-offload-pinned -- --nproc "$OFFLOAD_NPROC" --strategy fsdp-offload --set model.preset=lab
P_END=$(( STEPS < 5 ? STEPS : 5 )); P_START=$(( P_END < 3 ? P_END : 3 ))
if step profile-memory-snapshot -- --nproc 1 --strategy single --set model.preset=lab \
        --set profile.enabled=true --set profile.start_step=$P_START --set profile.end_step=$P_END; then
    snap="$OUT/profile-memory-snapshot/profile/rank0.memory_snapshot.pickle"
    if "$PY" -c "import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb')); assert s['segments'], 'empty'; \
print(f'== memory snapshot: {len(s[\"segments\"])} segments, {sum(len(t) for t in s[\"device_traces\"])} trace entries')" "$snap"; then
        "$PY" -m shardwise profile "$OUT/profile-memory-snapshot" --top 10
    else
        echo "gpu.sh: FAILED: no readable memory snapshot at $snap" >&2
        FAILED+=("memory-snapshot")
    fi
fi

# --- one real GPU plays one rank of a bigger job (shardwise rehearse --device cuda) ---------------
# Rank 0 of llama-3-8b trained with fsdp on 8 GPUs: real tensors on this GPU, fake collectives, so
# max_memory_allocated and the step time are that rank's real ones (the planner's ground truth).
# Time-boxed on its own (REHEARSE_TIMEOUT_S, default 240 s) so the whole script stays short.
rehearse_one_gpu_rank() {
    local name="rehearse-llama-3-8b-rank0-of-8" log="$OUT/rehearse-llama-3-8b-rank0-of-8.txt"
    echo "gpu.sh: $name ..." >&2
    if ! timeout "${REHEARSE_TIMEOUT_S:-240}" "$PY" -m shardwise rehearse hf-shakespeare --device cuda --ranks 0 \
            --steps 3 --nproc 8 --strategy fsdp --set model.kind=hf --set model.hf_config=llama-3-8b \
            --set model.overrides.block_size=8192 --set parallel.precision=bf16-mixed \
            --set parallel.activation_checkpointing=full --set train.micro_batch_size=1 \
            --set train.grad_accum_steps=2 --rank-timeout "${REHEARSE_TIMEOUT_S:-240}" | tee "$log"; then
        echo "gpu.sh: FAILED: $name (see $log)" >&2
        FAILED+=("$name")
        return 1
    fi
    echo "== $name: $(grep '^verdict:' "$log")"
}
rehearse_one_gpu_rank

if (( ${#FAILED[@]} )); then
    echo "gpu.sh: ${#FAILED[@]} step(s) FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "gpu.sh: all steps passed ($NGPU GPU(s)); run directories under $OUT" >&2
