"""Where the transformers engine's log-probs and the trainer's recompute part, module by module (--precision.bitwise).

One run samples with HFEngine on the batch-invariant kernels, recomputes every sampled token with the trainer's
Actor (padded and packed) and counts the log-probs whose bits differ, with the sequences and positions. Then it
takes the first differing token (or the first token of the longest response when none differ), samples again
with the same seed under forward hooks, and compares every module's output for that token: the engine's KV-cached
decode step against the same row of the trainer's padded forward. It prints, in the engine's execution order,
how many elements differ in their bits, so the first module listed with a difference is where the two part. The
last lines score the one logit row both ways: the engine's fp32 logits (transformers' generate upcasts them) and
the trainer's model-dtype logits through `invariant_log_probs`.

    python benchmarks/bitwise_probe_gpu.py                          # tiny Llama of tests/gpu (hidden 576), bf16, CUDA
    python benchmarks/bitwise_probe_gpu.py --recipe jet_fp8         # FP8 linears on triton_invariant
    python benchmarks/bitwise_probe_gpu.py --model /tmp/smol_hf --prompts 4 --max-new-tokens 256
    TRITON_INTERPRET=1 python benchmarks/bitwise_probe_gpu.py --device cpu --hidden 64 --max-new-tokens 6   # CPU

Exit status 0 when every log-prob has the trainer's bits, 1 otherwise; `--out FILE` also writes the findings as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tiny_llama(path: Path, a) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.int8}[t.element_size()])


def _first_tensor(out):
    if hasattr(out, "to_tuple"):  # a transformers ModelOutput
        out = out.to_tuple()
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


class _Recorder:
    """Forward hooks on every submodule that keep the output row of one sequence at one position, during the
    forward calls for which `want()` is true."""

    def __init__(self, model: torch.nn.Module, row: int, pos: int, want) -> None:
        self.row, self.pos, self.want, self.rows = row, pos, want, {}
        self.order: list[str] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str):
        def hook(module, args, out):
            t = _first_tensor(out)
            if t is None or t.dim() < 2 or not self.want():
                return
            if name not in self.rows:
                self.order.append(name)
            self.rows[name] = (tuple(t.shape), t[self.row, self.pos].detach().clone() if t.shape[0] > self.row else None)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local model folder (default: a tiny random Llama, the GPU test's)")
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--generate-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--out", default=None, help="also write the findings to this JSON file")
    a = p.parse_args(argv)

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.batch_invariant import invariant_log_probs, make_batch_invariant
    from openrlhf.models.actor import Actor, load_causal_lm, position_ids_from_mask
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.hf_engine import HFEngine
    from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync

    dev = torch.device(a.device)
    kernels = "triton"  # the CUDA path's kernels; on CPU they need TRITON_INTERPRET=1
    tmp = tempfile.TemporaryDirectory()
    model = a.model or tmp.name
    if a.model is None:
        _tiny_llama(Path(tmp.name), a)
    r = get_recipe(a.recipe)
    if dev.type == "cuda":  # FP8 linears on the batch-invariant GEMM
        r = dataclasses.replace(r, gemm_backend="triton_invariant")
    engine = HFEngine(model, r, dtype=torch.bfloat16, batch_invariant=True, invariant_kernels=kernels,
                      generate_batch_size=a.generate_batch_size, device=dev)
    trainer = make_batch_invariant(convert_to_fp8(load_causal_lm(model, torch.bfloat16, "sdpa").to(dev), r, side="train"),
                                   kernels=kernels).eval()
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (a.prompts,), generator=g)]
    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature, n=1, seed=a.seed)
    exp = sample_after_sync(trainer, engine, r, prompts, sampling, 0)
    mask, rollout = exp.action_mask.cpu().bool(), exp.rollout_logprobs.float().cpu()
    seqs, attn = exp.sequences.to(dev), exp.attention_mask.to(dev)
    report: dict = {"model": a.model or "tiny", "recipe": r.name, "device": str(dev), "tokens": int(mask.sum())}
    first = None
    for packing in (False, True):
        with torch.no_grad():
            lp = Actor(trainer, packing=packing)(seqs, attn, exp.num_actions, temperature=a.temperature).float().cpu()
        diff = (_bits(lp) != _bits(rollout)) & mask
        where = [(b, int(t)) for b in range(diff.shape[0]) for t in torch.nonzero(diff[b])[:, 0]]
        per_seq = {b: [t for bb, t in where if bb == b] for b in sorted({b for b, _ in where})}
        report[f"packing={packing}"] = {"differ": len(where), "per_sequence": {str(b): ts for b, ts in per_seq.items()}}
        print(f"log-probs, packing={packing}: {len(where)} of {int(mask.sum())} differ in their bits")
        for b, ts in per_seq.items():
            print(f"  seq {b} (response length {int(mask[b].sum())}, batch {b // a.generate_batch_size}): positions {ts}")
        if where and first is None:
            first = min(where, key=lambda bt: (bt[1], bt[0]))
    ok = first is None
    if first is None:  # nothing differs: still compare the modules at one decode step
        b = int(mask.sum(-1).argmax())
        first = (b, min(int(mask[b].sum()) - 1, 1))
    b, t = first
    report["probe"] = {"sequence": b, "position": t}
    print(f"module outputs at sequence {b}, response position {t} ({'first difference' if not ok else 'no difference: a sample token'})")

    # The engine, again with the same seed: batch b // gbs, row b % gbs, its forward call t (0 = the prefill).
    batch, row = divmod(b, a.generate_batch_size)
    calls = {"batch": -1, "call": -1}

    def new_batch(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None or cache.get_seq_length() == 0:
            calls["batch"] += 1
            calls["call"] = -1
        calls["call"] += 1

    hook = engine.model.register_forward_pre_hook(new_batch, with_kwargs=True)
    rec_e = _Recorder(engine.model, row, -1, lambda: calls["batch"] == batch and calls["call"] == t)
    again = engine.generate(prompts, sampling)
    rec_e.remove()
    hook.remove()
    if [s.response_ids for grp in again for s in grp][b] != exp.sequences[b, -exp.num_actions :][mask[b]].tolist():
        print("the second sampling gave other tokens: the engine is not deterministic; module comparison skipped")
        report["modules"] = None
    else:
        col = seqs.shape[1] - exp.num_actions - 1 + t
        rec_t = _Recorder(trainer, b, col, lambda: True)
        with torch.no_grad():
            logits = trainer(input_ids=seqs, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False).logits
        rec_t.remove()
        modules = []
        for name in rec_e.order:
            (se, e), (st, tr) = rec_e.rows[name], rec_t.rows.get(name, (None, None))
            if e is None or tr is None or e.shape != tr.shape or e.dtype != tr.dtype:
                line = {"module": name, "compared": False, "engine_shape": list(se), "trainer_shape": list(st) if st else None}
            else:
                d = int((_bits(e) != _bits(tr)).sum())
                line = {"module": name, "compared": True, "differ": d, "of": e.numel(),
                        "max_abs": float((e.double() - tr.double()).abs().max())}
            modules.append(line)
            shown = (f"{line['differ']:>6} of {line['of']:<6} differ (max |d| {line['max_abs']:.3g})" if line["compared"]
                     else f"not compared (engine {list(se)}, trainer {list(st) if st else None})")
            print(f"  {name:<48} {shown}")
        report["modules"] = modules
        diverged = next((m["module"] for m in modules if m.get("differ")), None)
        report["first_module_that_differs"] = diverged
        print(f"first module whose output differs: {diverged}")
        # The one logit row, scored both ways.
        lab = seqs[b, col + 1].view(1)
        row_t = logits[b, col].view(1, -1)
        lp_model_dtype = invariant_log_probs(row_t, lab, a.temperature)
        lp_fp32 = invariant_log_probs(row_t.float(), lab, a.temperature)
        same = bool((_bits(lp_model_dtype) == _bits(lp_fp32)).all())
        report["logprob_fp32_vs_model_dtype_logits_same_bits"] = same
        print(f"invariant_log_probs of the trainer's {row_t.dtype} logit row vs its fp32 copy: "
              f"{'same bits' if same else 'DIFFERENT bits'} ({lp_model_dtype.item():.9g} vs {lp_fp32.item():.9g})")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    print("bitwise: " + ("every log-prob has the trainer's bits" if ok else "log-probs differ"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
