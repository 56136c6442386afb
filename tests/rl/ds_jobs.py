"""Multi-rank DeepSpeed jobs the flag tests launch with torchrun (gloo, CPU); rank 0 writes a JSON result.

    torchrun --nproc_per_node 4 tests/rl/ds_jobs.py zpg OUT.json
    torchrun --nproc_per_node 2 tests/rl/ds_jobs.py universal-save CKPT_DIR
    torchrun --nproc_per_node 1 tests/rl/ds_jobs.py universal-load CKPT_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jetrl_precision import convert_to_fp8, get_recipe, mark_weights_updated  # noqa: E402
from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig  # noqa: E402


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


if __name__ == "__main__":
    job, *args = sys.argv[1:]
    {"zpg": zpg, "universal-save": universal_save, "universal-load": universal_load}[job](*args)
