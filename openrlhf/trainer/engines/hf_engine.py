"""A transformers-based rollout engine: the portable engine for machines without vLLM.

It holds its own copy of the policy, converted with the recipe's *rollout* flow, so it runs
the very same FP8 modules as the trainer. Synced FP8 layers are installed as bytes
(`Fp8Linear.install_quantized_weight`), never re-quantized; high-precision tensors are
copied (for `fp8_rollout` the engine then quantizes them itself, like VeRL's vLLM path).

Its log-probs come from the same function as the trainer's recompute (`log_probs_from_logits`), so
with `batch_invariant=True` (the policy's batch-invariant numerics, --precision.bitwise) they are
the trainer's bit for bit.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch

from jetrl_precision import PrecisionRecipe, QuantizedTensor, build_precision_graph, convert_to_fp8, fp8_linears
from jetrl_precision.batch_invariant import invariant_log_probs, make_batch_invariant, uses_triton_kernels
from jetrl_precision.graph import canonical_name
from jetrl_precision.weight_sync import SyncTensor, sync_tensor_digest

from openrlhf.models.utils import log_probs_from_logits

from .base import RolloutEngine, RolloutSample, SamplingConfig

__all__ = ["HFEngine"]

logger = logging.getLogger(__name__)


class HFEngine(RolloutEngine):
    name = "hf"
    sync_layout = "model"  # a transformers model: parameters as transformers holds them in memory

    def __init__(
        self,
        model_path: str,
        recipe: PrecisionRecipe,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        attn_implementation: str = "sdpa",
        generate_batch_size: int = 64,
        batch_invariant: bool = False,
        invariant_kernels: str | None = None,
        fuse_rmsnorm: bool = True,
    ) -> None:
        """`batch_invariant`: run the batch-invariant numerics (`jetrl_precision.batch_invariant`); needs
        `attn_implementation="jetrl_invariant"`, and raises BitwiseUnavailable where the kernels are missing.
        `invariant_kernels`: `make_batch_invariant`'s `kernels` (None: the device's; "triton" on CPU runs the CUDA
        path's kernels in Triton's interpreter, for tests and benchmarks/bitwise_probe_gpu.py). `fuse_rmsnorm`:
        `convert_to_fp8`'s, as the trainer's (--precision.plain_norms), so both run the same norms."""
        from openrlhf.models.actor import load_causal_lm

        self.recipe = recipe
        self.device = torch.device(device)
        self.generate_batch_size = generate_batch_size
        self.model = load_causal_lm(model_path, dtype, attn_implementation).to(self.device).eval()
        self.model.requires_grad_(False)
        convert_to_fp8(self.model, recipe, side="rollout", fuse_rmsnorm=fuse_rmsnorm)
        if batch_invariant:
            make_batch_invariant(self.model, kernels=invariant_kernels)
        self._invariant_log_probs = uses_triton_kernels(self.model)  # then score on the device, as the trainer
        self._fp8 = {canonical_name(n) + ".weight": m for n, m in fp8_linears(self.model).items()}
        self._params = {canonical_name(n): p for n, p in self.model.named_parameters(remove_duplicate=False)}
        cfg = self.model.config
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id

    # ---- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        flat = [list(p) for p in prompts for _ in range(sampling.n)]
        results: list[RolloutSample] = []
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for start in range(0, len(flat), self.generate_batch_size):
                results += self._generate_batch(flat[start : start + self.generate_batch_size], sampling)
        return [results[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], s: SamplingConfig) -> list[RolloutSample]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = s.temperature <= 0
        eos = [self.eos_token_id, *s.stop_token_ids] if self.eos_token_id is not None else list(s.stop_token_ids)
        if s.ignore_eos:  # an empty list, not None: None would fall back to the model's generation config
            eos = []
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else s.temperature,
            top_p=None if greedy else s.top_p,
            top_k=None if greedy or s.top_k <= 0 else s.top_k,
            max_new_tokens=s.max_new_tokens,
            eos_token_id=eos if s.ignore_eos else (eos or None),
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:].cpu()
        # Raw logits -> logprobs of the full-vocab, temperature-scaled distribution, by the trainer's own
        # function (top-p renormalisation would bias the IS ratio).
        temp = 1.0 if greedy else s.temperature
        if self._invariant_log_probs:  # the trainer's batch-invariant kernel, on the logits' device
            logits = torch.stack(out.logits, dim=1)
            lps = invariant_log_probs(logits, out.sequences[:, width : width + logits.shape[1]], temp).cpu()
        else:
            logits = torch.stack(out.logits, dim=1).cpu()
            lps = log_probs_from_logits(logits, new[:, : logits.shape[1]], temperature=temp)
        samples = []
        for i, p in enumerate(prompts):
            toks = new[i].tolist()
            stop_at = next((j for j, t in enumerate(toks) if t in eos), None)
            n = len(toks) if stop_at is None else stop_at + 1
            samples.append(RolloutSample(p, toks[:n], lps[i, :n].tolist(), "stop" if stop_at is not None else "length"))
        return samples

    # ---- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, tensors: Iterable[SyncTensor]) -> None:
        for t in tensors:
            if t.scale is not None:
                layer = self._fp8.get(t.name)
                if layer is None:
                    raise KeyError(f"hf engine: got FP8 bytes for {t.name}, which is not an FP8 layer here (recipe {self.recipe.name})")
                layer.install_quantized_weight(QuantizedTensor(t.data.to(self.device).clone(), t.scale.to(self.device).clone(), t.block))
                continue
            param = self._params.get(t.name)
            if param is None:
                raise KeyError(f"hf engine: unknown parameter {t.name}")
            param.copy_(t.data.to(param.device, param.dtype))
            layer = self._fp8.get(t.name)
            if layer is not None:  # high-precision weight into an FP8 layer: quantize here (fp8_rollout)
                layer.install_quantized_weight(None)

    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        out = {}
        for name in names:
            layer = self._fp8.get(name)
            if layer is not None and layer._installed is not None:
                wq = layer.quantized_weight()
                out[name] = sync_tensor_digest(SyncTensor(name, wq.data, wq.scale, wq.block))
            elif name in self._params:
                out[name] = sync_tensor_digest(SyncTensor(name, self._params[name].detach()))
            else:
                raise KeyError(f"hf engine: no tensor named {name}")
        return out

    def precision_graph(self) -> dict:
        g = build_precision_graph(self.model, self.recipe, "rollout")
        g.meta["engine"] = self.name
        return g.to_dict()
