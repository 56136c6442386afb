"""OpenRLHF v0.11 training features, unit by unit: dynamic-batching partitions, reward shaping,
DAPO dynamic filtering, GSPO and seq-mask-tis losses, and multi-turn agent rollouts through a
user's agent file on the real transformers engine."""

from __future__ import annotations

import math

import pytest
import torch

from openrlhf.models.loss import ISCorrection, PolicyLoss, aggregate_loss, sequence_mean_weights
from openrlhf.trainer.ppo_utils.reward_shaping import dynamic_filter_keep, overlong_penalty, stop_properly_penalty
from openrlhf.utils.seqlen_balancing import synced_partition, token_budget_partition


# ---- dynamic batching --------------------------------------------------------------------------
def test_partition_respects_the_token_budget_and_covers_every_sample():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (57,), generator=g).tolist()
    parts = token_budget_partition(lengths, 1000)
    assert sorted(i for p in parts for i in p) == list(range(57))
    assert all(sum(lengths[i] for i in p) <= 1000 for p in parts)
    assert len(parts) <= math.ceil(sum(lengths) / 1000) + 2  # greedy is near the lower bound


def test_partition_edge_cases():
    assert token_budget_partition([50, 700, 20], 100) == [[1], [0, 2]]  # an over-long sample runs alone
    assert token_budget_partition([3, 4], 100, min_parts=3) == [[0], [1], []]
    # Ranks agree on the largest count: this rank's 2 small samples become 2 parts, not 1.
    assert len(synced_partition([10, 10], 100, all_reduce_max=lambda k: max(k, 2))) == 2


# ---- reward shaping and filtering ----------------------------------------------------------------
def test_overlong_and_stop_properly_penalties():
    pen = overlong_penalty(torch.tensor([10, 70, 90, 100, 120]), max_new_tokens=100, buffer_len=40, factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.125, -0.375, -0.5, -0.5]))
    r = torch.tensor([1.0, 1.0, 0.0])
    trunc = torch.tensor([True, False, True])
    assert stop_properly_penalty(r, trunc, 0.0).tolist() == [0.0, 1.0, 0.0]
    assert stop_properly_penalty(r, trunc, -0.5).tolist() == [-0.5, 1.0, -0.5]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([1]), 10, 20)


def test_dynamic_filter_drops_groups_with_equal_rewards():
    scores = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.float32)
    assert dynamic_filter_keep(scores, 4, 0.0, 1.0).tolist() == [False, True, False]
    assert dynamic_filter_keep(scores, 4, 0.3, 1.0).tolist() == [False, False, False]


# ---- losses ----------------------------------------------------------------------------------------
def test_seq_mask_tis_masks_whole_sequences_by_geometric_mean():
    old = torch.zeros(2, 3)
    rollout = torch.tensor([[0.0, -0.1, 0.1], [-2.0, -2.0, 0.0]])  # row 1: mean log w = 4/3 -> w = 3.8 > 2
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, out = ISCorrection("seq-mask-tis", 0.5, 2.0).weights(old, rollout, mask)
    assert out[1].all() and not out[0].any()
    assert torch.all(w[1] == 0)
    torch.testing.assert_close(w[0], (old - rollout)[0].exp().clamp(0.5, 2.0))


def test_gspo_uses_one_ratio_per_sequence():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.ones(2, 3)
    out = PolicyLoss(0.2, 0.2, loss_type="gspo")(logp, old, adv, mask)
    seq_ratio = math.exp((0.5 + 0.0) / 2)  # row 0: tokens 0,1 only
    assert out.token_loss[0, 0].item() == pytest.approx(-min(seq_ratio, 1.2))
    assert out.token_loss[0, 1].item() == out.token_loss[0, 0].item() and out.token_loss[0, 2].item() == 0
    w = sequence_mean_weights(mask)
    loss = aggregate_loss(out.token_loss * w, mask, global_num_tokens=2)
    # Sequence mean: each row's mean token loss, averaged over the two rows.
    assert loss.item() == pytest.approx((out.token_loss[0, :2].mean() + out.token_loss[1].mean()).item() / 2)


# ---- agent execution ------------------------------------------------------------------------------------
AGENT_FILE = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        return {"rewards": 1.0 if done else 0.0, "scores": 0.5 * self.turn, "environment_feedback": "" if done else "\\nTRY:",
                "done": done, "sampling_params": states["sampling_params"], "extra_logs": {"turns": self.turn}}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_agent_file_runs_multi_turn_episodes_on_the_transformers_engine(tmp_path):
    from jetrl_precision import get_recipe
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.hf_engine import HFEngine
    from openrlhf.trainer.ppo_utils.experience_maker import samples_to_tensors
    from openrlhf.utils.agent import AgentRollout, load_agent_executor
    from openrlhf.utils.tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path / "m")
    agent_file = tmp_path / "agent.py"
    agent_file.write_text(AGENT_FILE)
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(str(path), get_recipe("jet_fp8"), dtype=torch.float32)
    rollout = AgentRollout(load_agent_executor(str(agent_file)), engine, tok, max_length=40)
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, n=2, seed=3)
    groups = rollout.generate(["1+1=", "2+2="], [None, None], sampling, max_new_tokens=5)
    assert [len(g) for g in groups] == [2, 2]
    feedback = tok("\nTRY:", add_special_tokens=False)["input_ids"]
    for s in (s for g in groups for s in g):
        assert s.extra["reward"] == 1.0 and s.extra["score"] == 1.0 and s.extra["extra_logs"] == {"turns": 2.0}
        mask = s.action_mask
        assert len(mask) == len(s.response_ids) == len(s.logprobs)
        # Two model turns with the feedback between them: feedback tokens are context, not action.
        first_turn = mask.index(False)
        assert s.response_ids[first_turn : first_turn + len(feedback)] == feedback
        assert not any(mask[first_turn : first_turn + len(feedback)]) and all(mask[:first_turn])
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask) if not m) and all(lp < 0 for lp, m in zip(s.logprobs, mask) if m)
    exp = samples_to_tensors([s for g in groups for s in g], tok.pad_token_id)
    assert exp.action_mask.sum().item() == sum(sum(s.action_mask) for g in groups for s in g)


def test_agent_file_errors_are_one_line(tmp_path):
    from openrlhf.utils.agent import load_agent_executor

    with pytest.raises(FileNotFoundError, match="agent_func_path"):
        load_agent_executor(str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("class AgentExecutor: pass\n")
    with pytest.raises(TypeError, match="AgentExecutorBase"):
        load_agent_executor(str(bad))
