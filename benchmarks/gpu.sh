#!/usr/bin/env bash
# GPU figures and the CUDA-only paths CI cannot reach (CI has no GPU), in one short visit.
#
#   benchmarks/gpu.sh [OUT_DIR]          # default OUT_DIR: runs/gpu-bench
#
# A GPU machine is lent rarely and briefly, so this runs as a list of steps, each time-boxed (its
# box in seconds is next to its name in STEP_LIST below), printing its figures the moment it has
# them and appending them to ONE summary file, OUT_DIR/summary.jsonl (one JSON object per step),
# so a visit cut short still leaves every figure measured so far. The steps:
#   env             torch, CUDA and GPU versions
#   gpt2-mfu        GPT-2 124M shape (12 x 768, context 1024, vocab 50304), one GPU, the defaults'
#                   bf16-mixed + torch.compile: tokens/s, MFU, peak memory vs the planner's prediction
#   fsdp-1rank      FSDP2 on one NCCL rank (lab preset)
#   offload-pinned  fsdp-offload: FSDP2 CPUOffloadPolicy with pinned host memory
#   varlen          packed documents: torch's varlen FlashAttention path vs the dense mask (tokens/s,
#                   and the two losses must agree)
#   ring-kernel     ring attention's flash / memory-efficient kernels on one rank vs plain SDPA
#   memory-snapshot the profiler's CUDA memory snapshot (the pickle pytorch.org/memory_viz opens)
#   rehearse-8b     `shardwise rehearse --device cuda`: rank 0 of llama-3-8b on 8 GPUs (fsdp, bf16,
#                   context 8192) played on this one GPU with real tensors and fake collectives: its
#                   measured peak against the planner's (docs/rehearse.md)
# Extra steps (not in the 8-minute visit; name them in GPU_SH_STEPS when time is left):
#   cuda-tests      the tests that run only on a GPU (no host sync on a step that does not log)
#   checkpoint-async a 0.3B model's saves on one GPU, sync against async-pinned: the time each save
#                   blocked the step, the write in the background, the step time around them
#   mfu-profile     the gpt2-mfu run with the profiler on 3 steps, then `shardwise profile`: where the
#                   step's time goes (kernels vs idle) and the top kernels
#   gpt2-chunked    the gpt2-mfu run with its loss in 4 chunks (train.loss_chunks = 4; `auto` keeps
#                   this run's 1.5 GiB of logits whole): what fewer, larger chunks cost
#   mfu-peers       `shardwise bench`: the same GPT-2 shape as shardwise's single-GPU run and as a plain
#                   PyTorch loop (torch-ddp on one rank), both bf16-mixed + per-block compile
#   rehearse-70b    rank 0 of the plan's recommendation for llama-3-70b on 4 x 8 H100 (fsdp+tp, tp 4,
#                   selective AC, 8,192 tokens) played on this GPU: measured peak and step time vs the plan
#   kernel-rates    the matrix-product and attention rates the planner prices a step with, measured at
#                   llama-3-8b's shapes (forward + backward, bf16) beside the planner's for an H200
# Every `shardwise train` step reports the planner's predicted peak next to the measured one.
# To add a step: write a function step_<name> (it may call train_step / py_step) and add
# "<name> <box seconds>" to STEP_LIST; docs/performance.md adds the boxes up into the visit's length.
#
# Exit: 0 when every step passed, 1 when any failed or ran out of its box (named at the end), 77
# when there is no GPU at all (the automake "skipped" code: nothing was measured).
#
# Knobs (environment): PYTHON (default .venv/bin/python next to this repo); GPU_SH_FORCE_CPU=1 runs
# every step on the CPU with tiny shapes and a few steps, to check the script itself in CI (the
# figures mean nothing there; CUDA-only parts report themselves as skipped); GPU_SH_BOX_SCALE
# multiplies every box (default 1 on a GPU, 3 on the CPU check); GPU_SH_STEPS="name ..." runs only those
# steps (of STEP_LIST and EXTRA_STEPS), in that order, e.g. to rerun the ones that failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Every line as it is printed: a step killed at its box keeps what it had printed (tee is a pipe,
# which Python would otherwise block-buffer until exit).
export PYTHONUNBUFFERED=1
OUT="${1:-runs/gpu-bench}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"

# name and time box (seconds on one H100). The boxes add up to 480 s; the machine's start-up and
# this script's own overhead come on top (docs/performance.md).
STEP_LIST=(
    "env 15"
    "gpt2-mfu 150"
    "fsdp-1rank 60"
    "offload-pinned 60"
    "varlen 45"
    "ring-kernel 20"
    "memory-snapshot 45"
    "rehearse-8b 85"
)
EXTRA_STEPS=(
    "cuda-tests 40"
    "checkpoint-async 120"
    "mfu-profile 90"
    "gpt2-chunked 75"
    "mfu-peers 150"
    "rehearse-70b 240"
    "kernel-rates 30"
)
SELECTED=()
if [[ -n "${GPU_SH_STEPS:-}" ]]; then
    for want in $GPU_SH_STEPS; do
        found=""
        for entry in "${STEP_LIST[@]}" "${EXTRA_STEPS[@]}"; do
            [[ "${entry%% *}" == "$want" ]] && found="$entry"
        done
        if [[ -z "$found" ]]; then
            names="$(for e in "${STEP_LIST[@]}" "${EXTRA_STEPS[@]}"; do printf '%s ' "${e%% *}"; done)"
            echo "gpu.sh: GPU_SH_STEPS names an unknown step '$want'; the steps are: $names" >&2
            exit 2
        fi
        SELECTED+=("$found")
    done
else
    SELECTED=("${STEP_LIST[@]}")
fi

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)"
if [[ -z "$NGPU" ]]; then
    echo "gpu.sh: cannot import torch with $PY; run scripts/bootstrap first (or set PYTHON=...)." >&2
    exit 1
fi
CPU_MODE=0
if [[ "$NGPU" == "0" && "${GPU_SH_FORCE_CPU:-0}" == "1" ]]; then
    echo "gpu.sh: GPU_SH_FORCE_CPU=1: running on the CPU with tiny shapes to check the script; the figures mean nothing." >&2
    CPU_MODE=1
elif [[ "$NGPU" == "0" ]]; then
    echo "gpu.sh: NO GPU on this machine (torch.cuda.is_available() is False): nothing was measured." >&2
    echo "gpu.sh: run it on a machine with a CUDA GPU; CPU figures come from 'shardwise bench'." >&2
    exit 77
fi

# On the CPU (a check of the script on a shared CI machine) every box is 3x longer unless told.
BOX_SCALE="${GPU_SH_BOX_SCALE:-$(( CPU_MODE ? 3 : 1 ))}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.jsonl"
: > "$SUMMARY"
FAILED=()
if (( CPU_MODE )); then
    STEPS=3
    LAB=(--set model.preset=nano --set train.micro_batch_size=4)
    GPT2=(--set model.preset=nano --set train.micro_batch_size=4)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    STEPS=60
    LAB=(--set model.preset=lab)
    GPT2=(--set model.preset=lab --set model.overrides.n_layer=12 --set model.overrides.n_head=12
          --set model.overrides.n_embd=768 --set model.overrides.block_size=1024
          --set model.overrides.vocab_size=50304 --set train.micro_batch_size=8)
fi
COMMON=(--set train.steps="$STEPS" --set train.sample_tokens=0 --set train.progress=false
        --set checkpoint.at_end=false --set train.eval_every=0 --set train.eval_batches=2 --set train.log_every=10)

note() {  # note STEP JSON: one line into the summary file
    printf '%s\n' "$2" >> "$SUMMARY"
}

report() {  # report NAME RUN_DIR: the figures of one finished run, printed and appended to the summary
    "$PY" - "$1" "$2" "$SUMMARY" <<'EOF'
import json, sys
name, run, summary_path = sys.argv[1:4]
s = json.load(open(f"{run}/summary.json"))
mem = s.get("memory") or {}
peaks = []
for row in mem.get("predicted_vs_measured") or []:
    if "peak_bytes" in row:
        peaks.append((row["rank"], row["peak_bytes"]["predicted"] / 2**30, row["peak_bytes"]["measured"] / 2**30))
if not peaks:  # on the CPU the ledger's peak is the process RSS, which the planner does not predict
    for r in mem.get("ranks") or []:
        pred = (r.get("predicted") or {}).get("peak_bytes")
        peaks.append((r["rank"], pred / 2**30 if pred else float("nan"), (r.get("peak_bytes") or 0) / 2**30))
fig = {"step": name, "strategy": s["strategy"], "world_size": s["world_size"], "precision": s.get("precision"),
       "compile": s.get("compile"), "tokens_per_s": s.get("tokens_per_s"), "step_time_s": s.get("step_time_s"),
       "mfu": s.get("mfu"), "peak_gib_predicted_measured": peaks, "final_train_loss": s.get("final_train_loss")}
ckpt = s.get("checkpoint_io") or {}
if ckpt.get("saves"):
    fig["checkpoint"] = ckpt
with open(summary_path, "a") as f:
    f.write(json.dumps(fig) + "\n")
mfu = f"{fig['mfu']:.1%}" if isinstance(fig["mfu"], float) else "n/a"
peak = ", ".join(f"rank {r}: {p:.2f} predicted / {m:.2f} measured GiB" for r, p, m in peaks)
print(f"== {name}: {fig['strategy']} x{fig['world_size']} {fig['precision']} compile={fig['compile']} | "
      f"{fig['tokens_per_s']:,.0f} tokens/s | step {fig['step_time_s'] * 1e3:.1f} ms | MFU {mfu} | peak {peak}",
      flush=True)
if "checkpoint" in fig:
    print(f"== {name}: {ckpt['saves']} saves blocked the step {ckpt['blocked_s_max']:.2f} s at most "
          f"({ckpt['blocked_s_total']:.2f} s in all); checkpoint_io: {json.dumps(ckpt)[:600]}", flush=True)
EOF
}

train_step() {  # train_step NAME -- shardwise train arguments...: one run, then its figures
    local name="$1"; shift; shift
    local run="$OUT/$name"
    rm -f "$run/summary.json"
    "$PY" -m shardwise train "$@" --out "$run" --overwrite "${COMMON[@]}" || return 1
    [[ -f "$run/summary.json" ]] || { echo "gpu.sh: $name wrote no summary.json" >&2; return 1; }
    report "$name" "$run"
}

py_step() {  # py_step NAME SCRIPT ARGS...: a benchmark script; its printed lines go into the summary
    local name="$1"; shift
    local log="$OUT/$name.log"
    "$PY" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    "$PY" -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "rc": int(sys.argv[2]), "lines": open(sys.argv[3]).read().splitlines()[-12:]}))' \
        "$name" "$rc" "$log" >> "$SUMMARY"
    return "$rc"
}

# ------------------------------------------------------------------------------ the steps
step_env() {
    "$PY" -m shardwise env
    note env "$("$PY" -c 'import json, torch; print(json.dumps({"step": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))')"
}

step_gpt2-mfu() {
    # What `auto` picks for a long run on a bf16 GPU; explicit here, since this run is short (runtime/auto.py).
    # (On the CPU check it stays eager: minutes of C++ compilation would check nothing more here.)
    train_step gpt2-mfu -- --nproc 1 --strategy single "${GPT2[@]}" \
        --set parallel.precision=bf16-mixed --set train.compile="$( (( CPU_MODE )) && echo false || echo true)"
}

step_fsdp-1rank() {
    train_step fsdp-1rank -- --nproc 1 --strategy fsdp "${LAB[@]}"
}

step_offload-pinned() {
    train_step offload-pinned -- --nproc 1 --strategy fsdp-offload "${LAB[@]}"
}

step_varlen() {
    if (( CPU_MODE )); then
        py_step varlen "$ROOT/benchmarks/varlen_attention.py" --seq 512 --steps 1
    else
        py_step varlen "$ROOT/benchmarks/varlen_attention.py" --seq 8192 --steps 5
    fi
}

step_ring-kernel() {
    if (( CPU_MODE )); then
        py_step ring-kernel "$ROOT/benchmarks/ring_kernel.py" --seq 256 --heads 2 --head-dim 16
    else
        py_step ring-kernel "$ROOT/benchmarks/ring_kernel.py" --seq 8192
    fi
}

step_memory-snapshot() {
    local p_end=$(( STEPS < 5 ? STEPS : 5 )); local p_start=$(( p_end < 3 ? p_end : 3 ))
    train_step memory-snapshot -- --nproc 1 --strategy single "${LAB[@]}" \
        --set profile.enabled=true --set profile.start_step=$p_start --set profile.end_step=$p_end || return 1
    if (( CPU_MODE )); then
        note memory-snapshot '{"step": "memory-snapshot", "skipped": "a CUDA memory snapshot needs a GPU"}'
        return 0
    fi
    local snap="$OUT/memory-snapshot/profile/rank0.memory_snapshot.pickle"
    "$PY" -c "import json, pickle, sys; s = pickle.load(open(sys.argv[1], 'rb')); assert s['segments'], 'empty'; \
r = {'step': 'memory-snapshot', 'segments': len(s['segments']), 'trace_entries': sum(len(t) for t in s['device_traces'])}; \
print('== memory snapshot:', r); open(sys.argv[2], 'a').write(json.dumps(r) + '\n')" "$snap" "$SUMMARY" || return 1
    "$PY" -m shardwise profile "$OUT/memory-snapshot" --top 10
}

step_rehearse-8b() {
    local what=(--set model.hf_config=llama-3-8b --set model.overrides.block_size=8192
                --set parallel.precision=bf16-mixed --set parallel.activation_checkpointing=full --device cuda)
    # The CPU check plays the same command's shape on the bundled tiny Llama (the 8B model's full
    # size on fake CPU tensors takes minutes here and checks nothing more of this script).
    (( CPU_MODE )) && what=(--set model.hf_config=llama-tiny --device cpu)
    py_step rehearse-8b -m shardwise rehearse hf-shakespeare --ranks 0 --steps 3 --nproc 8 --strategy fsdp \
        --set model.kind=hf --set train.micro_batch_size=1 --set train.grad_accum_steps=2 "${what[@]}"
}

step_cuda-tests() {
    (( CPU_MODE )) && { note cuda-tests '{"step": "cuda-tests", "skipped": "they need a GPU"}'; return 0; }
    py_step cuda-tests -m pytest -q -p no:cacheprovider "$ROOT/tests/test_step_phases.py" -k "cuda or sync"
}

step_checkpoint-async() {
    # A 0.3B GPT (24 x 1024) on one rank under fsdp: fp32 parameters and AdamW state, ~4.5 GB a save.
    local size=(--set model.preset=lab --set model.overrides.n_layer=24 --set model.overrides.n_embd=1024
                --set model.overrides.n_head=16 --set model.overrides.block_size=1024 --set train.micro_batch_size=8)
    (( CPU_MODE )) && size=("${LAB[@]}")
    local mode
    for mode in sync async-pinned; do
        train_step "checkpoint-$mode" -- --nproc 1 --strategy fsdp "${size[@]}" --set parallel.precision=bf16-mixed \
            --set train.compile=false --set checkpoint.mode=$mode --set checkpoint.every=$(( STEPS / 2 )) \
            --set checkpoint.keep_last=1 || return 1
    done
}

step_mfu-profile() {
    local p=(--set train.steps=30 --set profile.enabled=true --set profile.start_step=20 --set profile.end_step=23)
    (( CPU_MODE )) && p=(--set profile.enabled=true --set profile.start_step=1 --set profile.end_step=2)
    train_step mfu-profile -- --nproc 1 --strategy single "${GPT2[@]}" --set parallel.precision=bf16-mixed \
        --set train.compile="$( (( CPU_MODE )) && echo false || echo true)" "${p[@]}" || return 1
    py_step mfu-profile-top -m shardwise profile "$OUT/mfu-profile" --top 25
}

step_gpt2-chunked() {
    train_step gpt2-chunked -- --nproc 1 --strategy single "${GPT2[@]}" --set parallel.precision=bf16-mixed \
        --set train.compile="$( (( CPU_MODE )) && echo false || echo true)" --set train.loss_chunks=4
}

step_mfu-peers() {
    # bench's own --steps/--out; the step count of COMMON does not apply here.
    local steps=40; (( CPU_MODE )) && steps=3
    py_step mfu-peers -m shardwise bench --strategies single,torch-ddp --nproc 1 --steps "$steps" \
        --out "$OUT/mfu-peers" --overwrite "${GPT2[@]}" --set parallel.precision=bf16-mixed \
        --set train.compile="$( (( CPU_MODE )) && echo false || echo true)" --set train.sample_tokens=0 \
        --set train.eval_every=0 --set train.log_every=10 --set checkpoint.at_end=false
}

step_rehearse-70b() {
    # The command `shardwise plan --model llama-3-70b --gpus-per-node 8 --nodes 4 --cp 1` prints (its
    # recommendation: fsdp+tp, tp 4, selective-op AC, 4 micro-batches of 1 x 8,192), rank 0 played here.
    local what=(--set model.hf_config=llama-3-70b --set model.overrides.block_size=8192 --set parallel.tp=4
                --device cuda)
    # (the bundled tiny Llama's 2 kv heads take tp 2 at most)
    (( CPU_MODE )) && what=(--set model.hf_config=llama-tiny --set parallel.tp=2 --device cpu)
    py_step rehearse-70b -m shardwise rehearse hf-shakespeare --ranks 0 --steps 2 --nproc 8 --nnodes 4 \
        --strategy fsdp+tp --set model.kind=hf --set parallel.precision=bf16-mixed --set train.micro_batch_size=1 \
        --set train.grad_accum_steps=4 --set parallel.activation_checkpointing=selective-op \
        --set parallel.sequence_parallel=true --set parallel.grad_sync=microbatch "${what[@]}"
}

step_kernel-rates() {
    py_step kernel-rates "$ROOT/benchmarks/kernel_rates.py" --gpu h200 \
        --device "$( (( CPU_MODE )) && echo cpu || echo cuda)"
}

# ------------------------------------------------------------------------------ run them, each in its box
START=$(date +%s)
for entry in "${SELECTED[@]}"; do
    read -r name box <<< "$entry"
    box=$("$PY" -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$box" "$BOX_SCALE")
    echo "gpu.sh: $name (box ${box}s) ..." >&2
    t0=$(date +%s)
    # The step runs in a subshell under `timeout` (it kills the step's whole process group at the box).
    timeout --kill-after=10 "$box" bash -c "$(declare -p ROOT OUT PY SUMMARY STEPS CPU_MODE LAB GPT2 COMMON 2>/dev/null); \
$(declare -f note report train_step py_step "step_$name"); step_$name"
    rc=$?
    took=$(( $(date +%s) - t0 ))
    if (( rc == 124 || rc == 137 )); then
        echo "gpu.sh: TIMED OUT: $name after its ${box}s box" >&2
        note "$name" "{\"step\": \"$name\", \"timed_out_after_s\": $box}"
        FAILED+=("$name (timed out)")
    elif (( rc != 0 )); then
        echo "gpu.sh: FAILED: $name (exit $rc; see the output above; files under $OUT/$name*)" >&2
        note "$name" "{\"step\": \"$name\", \"failed\": $rc}"
        FAILED+=("$name")
    fi
    echo "gpu.sh: $name took ${took}s of its ${box}s box" >&2
done
TOTAL=$(( $(date +%s) - START ))
note total "{\"step\": \"total\", \"seconds\": $TOTAL, \"failed\": ${#FAILED[@]}, \"cpu_mode\": $CPU_MODE}"

if (( ${#FAILED[@]} )); then
    echo "gpu.sh: ${#FAILED[@]} step(s) FAILED: ${FAILED[*]} (${TOTAL}s; figures so far in $SUMMARY)" >&2
    exit 1
fi
echo "gpu.sh: all steps passed in ${TOTAL}s; figures in $SUMMARY, run directories under $OUT" >&2
