"""The learning task of benchmarks/fidelity_gpu.py: the named word-problem tasks, the chat the records carry, and the
flags that hand them to the trainer (no model runs here; tests/benchmarks/test_fidelity_gpu.py runs the stages)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity_gpu as fg  # noqa: E402
from openrlhf.datasets import PromptDataset, load_prompt_records, make_word_problem_records  # noqa: E402
from openrlhf.rewards import math_reward  # noqa: E402

# A ChatML template like SmolLM2's, on the repository's character tokenizer (no model hub here).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_default_task_is_one_addition_or_subtraction_after_two_solved_examples():
    plan = fg.LearnPlan()
    assert plan.task == "add_sub_10" and fg.TASKS[plan.task].steps == (1,)
    recs = fg.learn_records(plan, 200, seed=0)
    for r in recs:
        *shots, last = r["input"]
        assert [m["role"] for m in shots] == ["user", "assistant", "user", "assistant"] and last["role"] == "user"
        assert last["content"] == r["problem"]
        assert re.fullmatch(r"\d+[-+]\d+", r["expression"]) and str(eval(r["expression"])) == r["label"]  # noqa: S307
        assert all(2 <= int(x) <= 10 for x in re.findall(r"\d+", r["expression"]))
        # the examples' answers are in the format the reward reads
        for q, a in zip(shots[::2], shots[1::2]):
            expr = re.match(r"(\d+ [-+] \d+) =", a["content"]).group(1)
            assert math_reward([a["content"]], [str(eval(expr))]) == [1.0]  # noqa: S307
    assert {op for r in recs for op in "+-" if op in r["expression"]} == {"+", "-"}


def test_records_reach_the_trainer_as_chat_turns(tmp_path):
    from openrlhf.utils.tiny_model import build_char_tokenizer

    plan = fg.LearnPlan(steps=2, prompts=4)
    train, heldout = fg.learn_inputs(tmp_path, plan, "learn")
    problems = {p: [json.loads(x)["problem"] for x in p.read_text().splitlines()] for p in (train, heldout)}
    assert len(problems[train]) == 4 * 4 and len(problems[heldout]) == plan.eval_prompts
    assert not set(problems[train]) & set(problems[heldout])  # the runs never train on a held-out problem
    argv = plan.argv(Path("/m"), train, heldout, seed=0)
    assert "--data.apply_chat_template" in argv and "--data.input_template" not in argv  # the records hold the whole chat
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    ds = PromptDataset(load_prompt_records(str(train)), tok, input_key="input", label_key="label", apply_chat_template=True)
    first = json.loads(train.read_text().splitlines()[0])
    prompt = ds[0]["prompt"]
    assert prompt.count("<|im_start|>user") == 3 and prompt.endswith(first["problem"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert "9 + 4 = 13. The answer is 13." in prompt and ds[0]["label"] == first["label"]
    # the earlier task draws the same problems as before tasks had names, each as one user turn asking step by step
    old = fg.learn_records(fg.LearnPlan(task="mixed_30"), 8, seed=0)
    assert [r["problem"] for r in old] == [r["input"] for r in make_word_problem_records(8, seed=0, max_number=30)]
    assert old[0]["input"] == [{"role": "user", "content": fg.ONE.format(old[0]["problem"])}]
    # the tiny character model gets the bare problem
    tiny = fg.learn_records(fg.LearnPlan(tiny=True, max_number=5), 4, seed=0)
    assert all(isinstance(r["input"], str) for r in tiny)
