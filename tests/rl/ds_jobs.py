"""Multi-rank DeepSpeed jobs the flag tests launch with torchrun (gloo, CPU); rank 0 writes a JSON result.

    torchrun --nproc_per_node 4 tests/rl/ds_jobs.py zpg OUT.json
    torchrun --nproc_per_node 2 tests/rl/ds_jobs.py universal-save CKPT_DIR
    torchrun --nproc_per_node 1 tests/rl/ds_jobs.py universal-load CKPT_DIR OUT.json
    torchrun --nproc_per_node 2 tests/rl/ds_jobs.py tp OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: precision_testutil

from jetrl_precision import convert_to_fp8, get_recipe, mark_weights_updated  # noqa: E402
from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig  # noqa: E402
from openrlhf.utils.process import exit_after_run  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 128))
    return convert_to_fp8(model, get_recipe("jet_fp8"), side="train")


def _engine(st: DeepspeedStrategy):
    model = _model()
    return st.prepare(model, st.make_optimizer(model, 1e-2, (0.9, 0.95), 1e-8, 0.0))


def _steps(engine, st: DeepspeedStrategy, n: int) -> None:
    for k in range(n):
        g = torch.Generator().manual_seed(100 * k + st.rank)
        engine.backward(engine(torch.randn(2, 8, 256, generator=g)).square().mean())
        engine.step()
        mark_weights_updated()


def _full(st: DeepspeedStrategy, engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in (st.model_state_dict(engine, engine.module) or {}).items()}


def zpg(out: str) -> None:
    """ZeRO-3 with and without ZeRO++ hierarchical partitioning: the same training, bit for bit."""
    states, hpz = [], []
    for group in (1, 2):
        st = DeepspeedStrategy(StrategyConfig(zero_stage=3, param_dtype="fp32", micro_batch_size=2, train_batch_size=2 * 4, zpg=group))
        st.setup_distributed()
        engine = _engine(st)
        _steps(engine, st, 3)
        states.append(_full(st, engine))
        hpz.append(engine.zero_hpz_partition_size())
    if st.is_rank_0:
        equal = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
        moved = any(not torch.equal(states[0][k], v) for k, v in _model().state_dict().items())
        Path(out).write_text(json.dumps({"world": st.world_size, "hpz": hpz, "equal": equal, "moved": moved}))


def universal_save(ckpt: str) -> None:
    st = DeepspeedStrategy(StrategyConfig(zero_stage=2, param_dtype="fp32", micro_batch_size=2, train_batch_size=4))
    st.setup_distributed()
    engine = _engine(st)
    _steps(engine, st, 2)
    st.save_checkpoint(engine, ckpt, "global_step2", {"global_step": 2, "note": "saved at world size 2"})
    state = _full(st, engine)
    if st.is_rank_0:
        torch.save(state, Path(ckpt) / "reference_weights.pt")


def universal_load(ckpt: str, out: str) -> None:
    st = DeepspeedStrategy(StrategyConfig(zero_stage=2, param_dtype="fp32", micro_batch_size=2, train_batch_size=2, load_universal=True))
    st.setup_distributed()
    engine = _engine(st)
    client = st.load_checkpoint(engine, ckpt)
    ref = torch.load(Path(ckpt) / "reference_weights.pt")
    state = _full(st, engine)
    Path(out).write_text(json.dumps({
        "world": st.world_size, "client": client, "equal": all(torch.equal(state[k], ref[k]) for k in ref),
        "optimizer_step": int(engine.optimizer.optimizer.state[engine.optimizer.optimizer.param_groups[0]["params"][0]]["step"]),
    }))


def _envelope(t: torch.Tensor, quantizations: int = 1) -> torch.Tensor:
    """An upper bound of |dequantize(quantize(t))| elementwise, for any e4m3 group quantization of t: a relative
    2^-4 (half an ulp of 3 mantissa bits) and, below the normal range, half the smallest subnormal step of the
    group's scale (scale = group amax / 448 <= max|t| / 448, step 2^-9 of it); `quantizations` applies it again."""
    env = t.double().abs()
    for _ in range(quantizations):
        env = env * (1 + 2.0**-4 + 2.0**-20) + env.max() / 448 * 2.0**-10  # 2^-20: the fp32 scale division and product
    return env


def tp(out: str) -> None:
    """DeepSpeed AutoTP shards a Llama on 2 ranks, then its layers become FP8: every shard quantizes to its slice of
    the unsharded layer's bytes, the reassembled weight is the unsharded one, and forward, DGrad and WGrad of every
    layer match the unsharded FP8 layer within the fp32 accumulation bound; then one DeepSpeed step trains."""
    import copy

    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from jetrl_precision import fp8_linears
    from openrlhf.models.tensor_parallel import _Fp8ShardLinear, convert_autotp_to_fp8, gather_quantized_weight
    from precision_testutil import gamma, outlier_data

    deepspeed.init_distributed(dist_backend="gloo")
    rank, tp_size = dist.get_rank(), dist.get_world_size()
    recipe = get_recipe("jet_fp8")
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = convert_to_fp8(copy.deepcopy(model), recipe, fuse_swiglu=False)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
          "tensor_parallel": {"autotp_size": tp_size}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=ds)
    convert_autotp_to_fp8(engine.module, recipe)
    layers = {n: m for n, m in engine.module.named_modules() if isinstance(m, _Fp8ShardLinear)}
    refs = fp8_linears(ref)
    result = {"layers": sorted(layers), "kinds": {n: type(m).__name__ for n, m in layers.items()}, "bytes": {}, "gathered": {}, "worst": {}}
    g = torch.Generator().manual_seed(7)
    for name, layer in layers.items():
        r = refs[name]
        d, n = layer.split_dim, layer.weight.shape[layer.split_dim]
        cut = lambda t, dim=d: t.narrow(dim, rank * n, n)  # noqa: E731  this rank's slice along the split
        wq, rq = layer.quantized_weight(), r.quantized_weight()
        scale_rows = rq.scale.contiguous().narrow(d, rank * n // 128, n // 128)  # one scale per 128x128 block
        result["bytes"][name] = bool(torch.equal(wq.data.view(torch.uint8), cut(rq.data.view(torch.uint8))) and torch.equal(wq.scale, scale_rows))
        full = gather_quantized_weight(layer)
        result["gathered"][name] = bool(torch.equal(full.data.view(torch.uint8), rq.data.view(torch.uint8)) and torch.equal(full.scale, rq.scale))
        # forward + backward on the same data (with outliers) on every rank, against the unsharded FP8 layer
        m_tokens, (n_out, k_in) = 256, r.weight.shape
        x = outlier_data((m_tokens, k_in), generator=g)
        dy = outlier_data((m_tokens, n_out), generator=g)
        x_ref = x.clone().requires_grad_(True)
        y_ref = r(x_ref)
        y_ref.backward(dy)
        x_tp = (x if d == 0 else cut(x, 1)).clone().requires_grad_(True)
        layer.weight.grad = None
        y_tp = layer(x_tp)
        y_tp.backward(dy if d == 1 else cut(dy, 1).contiguous())
        w_env, x_env, dy_env = _envelope(r.weight.detach()), _envelope(x), _envelope(dy)
        checks = {  # (got, reference, bound): both sides use the same FP8 operands; only the fp32 sums differ
            "y": (y_tp, y_ref if d == 1 else cut(y_ref, 1), 2 * gamma(k_in + tp_size + 2) * (x_env @ w_env.t())),
            "dx": (x_tp.grad, x_ref.grad if d == 0 else cut(x_ref.grad, 1), 2 * gamma(n_out + tp_size + 2) * (dy_env @ w_env)),
            "dw": (layer.weight.grad, cut(r.weight.grad), 2 * gamma(m_tokens + 2) * (_envelope(dy).t() @ _envelope(x, 2))),
        }
        worst = {}
        for what, (got, want, bound) in checks.items():
            if d == 0 and what == "y":
                bound = cut(bound, 1)
            if d == 1 and what == "dx":
                bound = cut(bound, 1)
            if what == "dw":
                bound = cut(bound)
            worst[what] = float(((got.double() - want.double()).abs() / bound).max())
        result["worst"][name] = worst
    # one training step of the whole sharded FP8 model through DeepSpeed
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    before = {n: m.weight.detach().clone() for n, m in layers.items()}
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mark_weights_updated()
    result.update(loss=loss.item(), moved=all(not torch.equal(before[n], m.weight) for n, m in layers.items()),
                  shard_shapes={n: list(m.weight.shape) for n, m in layers.items()})
    ranks = [None] * tp_size
    dist.all_gather_object(ranks, result)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": ranks}))
    dist.barrier()


if __name__ == "__main__":
    job, *args = sys.argv[1:]
    {"zpg": zpg, "universal-save": universal_save, "universal-load": universal_load, "tp": tp}[job](*args)
    exit_after_run(0)  # every rank closes the process group together, as the training entry point does
