"""Prompt loading (jsonl/json/parquet/HF folders), PromptDataset, the synthetic arithmetic
task sets (expressions, word problems), the math-verify reward and file/HTTP reward functions."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from openrlhf.datasets import (
    PromptDataset,
    collate_prompts,
    evaluate_expression,
    load_prompt_records,
    make_arithmetic_records,
    make_word_problem_records,
    write_jsonl,
)
from openrlhf.datasets.synthetic import ONE_STEP_KINDS
from openrlhf.rewards import extract_final_number, load_reward_fn, math_reward
from openrlhf.rewards.remote import RewardFunctionError

RECORDS = [
    {"question": "What is 2+2?", "answer": 4, "id": 0},
    {"question": "Compute 7*6.", "answer": "42", "id": 1},
    {"question": "Halve 1.", "answer": "1/2", "id": 2},
]


# ---------------------------------------------------------------- loading


def test_load_jsonl_json_variants(tmp_path):
    p = write_jsonl(RECORDS, tmp_path / "a" / "p.jsonl")
    assert load_prompt_records(str(p)) == RECORDS
    assert load_prompt_records(str(p), max_samples=2) == RECORDS[:2]
    (tmp_path / "list.json").write_text(json.dumps(RECORDS))
    assert load_prompt_records(str(tmp_path / "list.json")) == RECORDS
    (tmp_path / "split.json").write_text(json.dumps({"train": RECORDS[:1], "test": RECORDS[1:]}))
    assert load_prompt_records(str(tmp_path / "split.json"), split="test") == RECORDS[1:]
    cols = {k: [r[k] for r in RECORDS] for k in RECORDS[0]}
    (tmp_path / "cols.json").write_text(json.dumps(cols))
    assert load_prompt_records(str(tmp_path / "cols.json")) == RECORDS
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in RECORDS))
    assert load_prompt_records(str(tmp_path / "lines.json")) == RECORDS


def test_load_parquet_and_hf_folders(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": r["question"], "answer": str(r["answer"])} for r in RECORDS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert load_prompt_records(str(tmp_path / "p.parquet")) == rows

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_prompt_records(str(tmp_path / "ds")) == rows
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows[2:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_prompt_records(str(tmp_path / "dd"), split="test") == rows[2:]
    with pytest.raises(ValueError, match="validation.*available splits.*test"):
        load_prompt_records(str(tmp_path / "dd"), split="validation")

    # folder of files with split names (HF hub layout)
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:1]), folder / "train-00000-of-00002.parquet")
    write_jsonl(rows[1:2], folder / "train-00001-of-00002.jsonl")
    write_jsonl(rows[2:], folder / "test.jsonl")
    assert load_prompt_records(str(tmp_path / "hub")) == rows[:2]
    assert load_prompt_records(str(tmp_path / "hub"), split="test") == rows[2:]
    with pytest.raises(ValueError, match="splits found"):
        load_prompt_records(str(tmp_path / "hub"), split="dev")
    # folder without split names: everything
    plain = tmp_path / "plain"
    write_jsonl(rows[:2], plain / "part_a.jsonl")
    write_jsonl(rows[2:], plain / "part_b.jsonl")
    assert load_prompt_records(str(plain), split="train") == rows


def test_load_errors_name_the_problem(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_records(str(missing))
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"x\.csv.*\.jsonl.*\.parquet"):
        load_prompt_records(str(tmp_path / "x.csv"))
    (tmp_path / "bad.jsonl").write_text('{"input": "1+1="}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_prompt_records(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="supported"):
        load_prompt_records(str(tmp_path / "empty"))


# ---------------------------------------------------------------- PromptDataset


@pytest.fixture(scope="module")
def char_tokenizer():
    from openrlhf.utils.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def test_prompt_dataset_plain_and_template(char_tokenizer):
    ds = PromptDataset(RECORDS, None, input_key="question", label_key="answer", input_template="Q: {} A:")
    assert len(ds) == 3
    assert ds[0] == {"prompt": "Q: What is 2+2? A:", "label": "4", "index": 0}
    assert ds[2]["label"] == "1/2"
    ds = PromptDataset(RECORDS, char_tokenizer, input_key="question")
    assert ds[1] == {"prompt": "Compute 7*6.", "label": None, "index": 1}


def test_prompt_dataset_chat_template_and_length_filter(char_tokenizer):
    ds = PromptDataset(RECORDS, char_tokenizer, input_key="question", label_key="answer", apply_chat_template=True)
    assert ds[0]["prompt"] == "<user>What is 2+2?\n<assistant>"
    msgs = [{"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "label": "x"}]
    ds = PromptDataset(msgs, char_tokenizer, apply_chat_template=True, label_key="label")
    assert ds[0]["prompt"] == "<system>Be brief.\n<user>Hi\n<assistant>"
    # character tokenizer: token count == character count. "Halve 1." is 8 chars, the others 12.
    ds = PromptDataset(RECORDS, char_tokenizer, input_key="question", max_prompt_len=10)
    assert [it["index"] for it in ds] == [2] and ds.num_dropped == 2
    with pytest.raises(ValueError, match="all 3 prompts are longer than 3 tokens"):
        PromptDataset(RECORDS, char_tokenizer, input_key="question", max_prompt_len=3)


def test_prompt_dataset_key_errors_list_available_keys():
    with pytest.raises(KeyError) as e:
        PromptDataset(RECORDS, None, input_key="prompt")
    msg = str(e.value)
    assert "--data.input_key" in msg and "'question'" in msg and "'answer'" in msg and "'prompt'" in msg
    with pytest.raises(KeyError) as e:
        PromptDataset(RECORDS, None, input_key="question", label_key="solution")
    assert "--data.label_key" in str(e.value) and "'answer'" in str(e.value)
    with pytest.raises(ValueError, match="input_template"):
        PromptDataset(RECORDS, None, input_key="question", input_template="no slot")
    with pytest.raises(ValueError, match="chat template"):
        from openrlhf.utils.tiny_model import build_char_tokenizer

        PromptDataset(RECORDS, build_char_tokenizer(), input_key="question", apply_chat_template=True)


def test_prompt_dataset_dataloader_collate():
    ds = PromptDataset(RECORDS, None, input_key="question")
    batches = list(torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate_prompts))
    assert batches[0] == {"prompt": ["What is 2+2?", "Compute 7*6."], "label": [None, None], "index": [0, 1]}
    assert batches[1]["index"] == [2]


# ---------------------------------------------------------------- synthetic tasks


@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_arithmetic_records_are_correct_and_regular(difficulty):
    recs = make_arithmetic_records(300, difficulty=difficulty, seed=11)
    assert len(recs) == 300
    for r in recs:
        assert set(r) == {"input", "label", "difficulty"} and r["difficulty"] == difficulty
        expr = r["input"]
        assert expr.endswith("=") and " " not in expr
        body = expr[:-1]
        assert sum(body.count(op) for op in "+-*") == difficulty
        assert all(c in "0123456789+-*" for c in body)
        # Python's own evaluator is independent of ours and has the same precedence.
        assert str(eval(body)) == r["label"]  # noqa: S307 - digits and +-* only, checked above
        assert int(r["label"]) >= 0
    assert len({r["input"] for r in recs}) > 50  # not degenerate


def test_arithmetic_records_deterministic_and_knobs(tmp_path):
    a = make_arithmetic_records(50, difficulty=2, seed=3)
    assert a == make_arithmetic_records(50, difficulty=2, seed=3)
    assert a != make_arithmetic_records(50, difficulty=2, seed=4)
    assert make_arithmetic_records(20, difficulty=2, seed=3) == a[:20]
    two = make_arithmetic_records(100, difficulty=2, answer_digits=2, seed=5)
    assert all(len(r["label"]) == 2 for r in two)
    three = make_arithmetic_records(30, difficulty=3, answer_digits=3, seed=5)
    assert all(len(r["label"]) == 3 for r in three)
    plus = make_arithmetic_records(30, difficulty=1, seed=1, operators="+", max_operand=50)
    assert all("+" in r["input"] for r in plus) and max(int(r["label"]) for r in plus) > 18
    with pytest.raises(ValueError, match="answer_digits"):
        make_arithmetic_records(5, difficulty=1, answer_digits=4)
    with pytest.raises(ValueError, match="difficulty"):
        make_arithmetic_records(5, difficulty=0)
    assert evaluate_expression([3, 4, 2], ["+", "*"]) == 11 and evaluate_expression([9, 2, 3, 4], ["-", "*", "-"]) == -1
    # round trip: file -> records -> dataset; the label is a correct answer under the math reward
    p = write_jsonl(make_arithmetic_records(40, difficulty=3, seed=9), tmp_path / "arith.jsonl")
    ds = PromptDataset(load_prompt_records(str(p)), None, input_key="input", label_key="label")
    labels = [it["label"] for it in ds]
    assert math_reward([l + "</s>" for l in labels], labels) == [1.0] * 40
    wrong = [str(int(l) + 1) for l in labels]
    assert math_reward(wrong, labels) == [0.0] * 40


def test_word_problems_are_correct_and_varied():
    recs = make_word_problem_records(400, seed=7)
    assert recs == make_word_problem_records(400, seed=7) and recs != make_word_problem_records(400, seed=8)
    for r in recs:
        assert set(r) == {"input", "label", "expression", "steps"}
        expr = r["expression"]
        assert re.fullmatch(r"\d+([-+*/]\d+){1,2}", expr), expr
        assert sum(expr.count(op) for op in "+-*/") == r["steps"]
        value = eval(expr)  # noqa: S307 - digits and +-*/ only, checked above; Python's evaluator, not ours
        assert value == int(value) and str(int(value)) == r["label"] and int(r["label"]) >= 0, r
        # every number of the arithmetic is stated in the text, in order
        pos = 0
        for num in re.findall(r"\d+", expr):
            m = re.compile(rf"\b{num}\b").search(r["input"], pos)
            assert m is not None, (expr, r["input"])
            pos = m.end()
        assert r["input"].endswith("?")
    assert {r["steps"] for r in recs} == {1, 2}
    assert {op for r in recs for op in "+-*/" if op in r["expression"]} == set("+-*/")
    assert len({r["input"] for r in recs}) > 350
    assert all(r["steps"] == 1 for r in make_word_problem_records(50, steps=[1], seed=1))
    # the label is what the math reward accepts, in the phrasing an instruct model uses
    labels = [r["label"] for r in recs[:20]]
    assert math_reward([f"So the answer is {l}." for l in labels], labels) == [1.0] * 20
    assert math_reward([f"So the answer is {int(l) + 1}." for l in labels], labels) == [0.0] * 20
    with pytest.raises(ValueError, match="steps"):
        make_word_problem_records(3, steps=[3])


def test_word_problem_kinds_and_operand_bound():
    easy = make_word_problem_records(200, steps=[1], seed=3, max_number=10, kinds=("add", "sub", "compare"))
    assert easy == make_word_problem_records(200, steps=[1], seed=3, max_number=10, kinds=("add", "sub", "compare"))
    assert {op for r in easy for op in "+-*/" if op in r["expression"]} == set("+-")
    assert all(2 <= int(x) <= 10 for r in easy for x in re.findall(r"\d+", r["expression"]))
    assert all(0 <= int(r["label"]) <= 20 and str(eval(r["expression"])) == r["label"] for r in easy)  # noqa: S307
    # the default kinds draw the same records as before the option existed
    assert make_word_problem_records(50, seed=7) == make_word_problem_records(50, seed=7, kinds=ONE_STEP_KINDS)
    with pytest.raises(ValueError, match="kinds"):
        make_word_problem_records(3, kinds=("add", "pow"))


def test_math_reward_on_what_smollm2_writes():
    """Answers as SmolLM2-135M-Instruct phrases them for the word problems (correct ones score 1, wrong ones 0)."""
    right = ["9 + 4 = 13. The answer is 13.", "The answer is 13 apples.", "Tom has 9 + 4 = 13 apples.\n\nThe answer is 13.",
             "#### 13\nThe answer is 13.", "13", "**The answer is 13.**<|im_end|>"]
    assert math_reward(right, ["13"] * len(right)) == [1.0] * len(right)
    # an echo of the arithmetic ("9 + 4 = ?", "4 + 9") is no answer, though math_verify would evaluate it to 13
    wrong = ["9 + 4 = 14. The answer is 14.", "The answer is 31.", "9 + 4 = ?", "4 + 9", "Tom has 9 apples and gets 4 more."]
    assert math_reward(wrong, ["13"] * len(wrong)) == [0.0] * len(wrong)
    assert math_reward(["12 * 3", "36", "72/2"], ["36"] * 3) == [0.0, 1.0, 1.0]


# ---------------------------------------------------------------- math reward


def test_math_reward_equivalent_forms_and_wrong_answers():
    responses = ["0.5", "1/2", "\\boxed{19}", "19", "The answer is $\\frac{3}{4}$.", "19</s><pad><pad>", "20", "1919", "-3"]
    labels = ["1/2", "0.5", "19", "\\boxed{19}", "0.75", "19", "19", "19", "3"]
    assert math_reward(responses, labels) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_math_reward_never_raises_on_garbage():
    garbage = [
        "",
        "\\frac{\\boxed{",
        "}}}}{{{{",
        "$$$$",
        "\x00\x01\x02 ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "9" * 5000 + "^" + "9" * 500,
        "\\boxed{}" * 200,
        None,
        "abc" * 20000,
    ]
    out = math_reward(garbage, ["19"] * len(garbage))
    assert out == [0.0] * len(garbage)
    assert math_reward(["19", "", "  "], [None, "", " "]) == [0.0, 0.0, 0.0]  # no label: never rewarded
    assert math_reward(["yes", "no"], ["yes", "yes"]) == [1.0, 0.0]  # non-math labels: exact text
    with pytest.raises(ValueError, match="labels"):
        math_reward(["1", "2"], ["1"])


def test_math_reward_in_worker_threads():
    # math_verify's signal-based timeout fails outside the main thread; we must still score.
    with ThreadPoolExecutor(2) as ex:
        out = list(ex.map(lambda rl: math_reward([rl[0]], [rl[1]])[0], [("19", "19"), ("0.5", "1/2"), ("7", "8")]))
    assert out == [1.0, 1.0, 0.0]


def test_extract_final_number():
    assert extract_final_number("19</s>") == "19"
    assert extract_final_number("19<|endoftext|>7") == "19"
    assert extract_final_number("first 3 then -12") == "-12"
    assert extract_final_number("1,234") == "1234"
    assert extract_final_number("x = 3 / 4") == "3/4"
    assert extract_final_number("0.25") == "0.25"
    assert extract_final_number("+7") == "7"
    assert extract_final_number("no digits") is None
    assert extract_final_number("") is None and extract_final_number(None) is None


# ---------------------------------------------------------------- reward functions


REWARD_PY = '''
import torch
CALLS = []
def reward_func(queries, prompts, labels, **kwargs):
    CALLS.append(len(queries))
    out = [float(q.endswith(l)) if l is not None else -1.0 for q, l in zip(queries, labels)]
    if kwargs.get("as_dict"):
        return {"rewards": torch.tensor(out), "scores": out, "extra_logs": {}}
    return torch.tensor(out)
'''


def test_load_reward_fn_py_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(REWARD_PY)
    fn = load_reward_fn(str(f))
    q, p, l = ["1+1=2", "2+2=5", "x"], ["1+1=", "2+2=", "x"], ["2", "4", None]
    assert fn(q, p, l) == [1.0, 0.0, -1.0]
    assert fn(q, p, l, as_dict=True) == [1.0, 0.0, -1.0]
    (tmp_path / "no_func.py").write_text("def other(): pass\n")
    with pytest.raises(RewardFunctionError, match="reward_func"):
        load_reward_fn(str(tmp_path / "no_func.py"))
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_fn(str(tmp_path / "missing.py"))
    (tmp_path / "short.py").write_text("def reward_func(q, p, l, **kw):\n    return [1.0]\n")
    with pytest.raises(ValueError, match="1 rewards for 3 queries"):
        load_reward_fn(str(tmp_path / "short.py"))(q, p, l)
    (tmp_path / "nokey.py").write_text("def reward_func(q, p, l, **kw):\n    return {'scores': [1.0]*len(q)}\n")
    with pytest.raises(ValueError, match="'rewards'"):
        load_reward_fn(str(tmp_path / "nokey.py"))(q, p, l)
    with pytest.raises(ValueError, match="remote_url"):
        load_reward_fn("reward.txt")


class _Handler(BaseHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append((self.path, body))
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path == "/bad":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"missing field")
            return
        rewards = [float(len(q) - len(p)) for q, p in zip(body["query"], body["prompts"])]
        payload = rewards if self.path == "/list" else {"rewards": rewards, "extra": 1}
        data = json.dumps(payload).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out on /slow
            pass


@pytest.fixture
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    watchdog = threading.Timer(30.0, server.shutdown)  # bounded even if a test hangs
    watchdog.daemon = True
    watchdog.start()
    _Handler.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        watchdog.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_load_reward_fn_http(reward_server):
    q, p, l = ["abc123", "ab"], ["abc", "a"], ["123", None]
    assert load_reward_fn(reward_server + "/score")(q, p, l) == [3.0, 1.0]
    assert load_reward_fn(reward_server + "/list")(q, p, l) == [3.0, 1.0]
    path, body = _Handler.requests[0]
    assert path == "/score" and body == {"query": q, "prompts": p, "labels": l}
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1.*/bad.*400"):
        load_reward_fn(reward_server + "/bad")(q, p, l)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"/slow.*2 attempt"):
        load_reward_fn(reward_server + "/slow", timeout=0.3, retries=1)(q, p, l)
    assert time.monotonic() - t0 < 5


def test_load_reward_fn_http_unreachable():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    url = f"http://127.0.0.1:{port}/reward"
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}/reward"):
        load_reward_fn(url, timeout=1.0, retries=0)(["a"], ["a"], [None])
