"""File the vLLM bitwise GPU test's job results as a benchmark run (the source of `bitwise_logprob_mismatch_smollm2`).

`tests/gpu/test_vllm_bitwise_gpu.py` with JETRL_RESULTS_DIR set leaves one JSON per recipe (`vllm_bitwise_job.py`):
the engine's sampled log-probs against the trainer's padded and packed recomputes. This turns them into records:

    python benchmarks/vllm_bitwise_record.py DIR [--command "..."]   # the device: the one the jobs recorded

One `bitwise_logprob_differing_tokens` record per recipe and layout (value: tokens whose log-prob bits differ; the
max |dlogp| beside it), and one `bitwise_logprob_mismatch` record per model: the largest |dlogp| over all of them,
0.0 exactly when every sampled token of every recipe had the trainer's bits. A run with the opt-in cuBLASLt route
(JETRL_INVARIANT_VENDOR_GEMM=probe) says so in its backends (`headline.route_suffix`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from headline import recorded_device, route_suffix, write_run  # noqa: E402

__all__ = ["records_from", "main"]

DEFAULT_COMMAND = ("JETRL_SMOLLM2=/tmp/smol_hf JETRL_RESULTS_DIR=$OUT/vbw python3 -m pytest -q "
                   "tests/gpu/test_vllm_bitwise_gpu.py  # after benchmarks/h200_fidelity.sh unpack install smollm2")


def _model_label(job: dict) -> str:
    name = Path(job["model"]).name
    if "smol" in name.lower():
        return "SmolLM2-135M-Instruct"
    if name.startswith("llama8b_l"):  # tests/gpu/test_vllm_bitwise_gpu.py with JETRL_BITWISE_8B_LAYERS
        return f"Llama-3.1-8B shape, {name.removeprefix('llama8b_l')} layers, random weights"
    return name


def records_from(jobs: list[dict], device: str | None, command: str) -> list[dict]:
    """The run's records from the jobs' JSON (see the module docstring); `device`: None takes the one the jobs recorded."""
    if not jobs:
        raise SystemExit("vllm_bitwise_record: no bitwise_*.json job results in that folder; run the GPU test with JETRL_RESULTS_DIR")
    device = recorded_device(jobs, device, "vllm_bitwise_record", "--device_name")
    out, by_model = [], {}
    for job in jobs:
        model = _model_label(job)
        shape = f"{model}, {job['prompts']} prompts at T=1, vLLM {job['mode']}"
        backend = job["recipe"] + route_suffix(job.get("vendor_route"))
        for layout in ("padded", "packed"):
            d = job[layout]
            out.append(dict(name="bitwise_logprob_differing_tokens", shape=f"{shape}, {layout} recompute", backend=backend,
                            value=d["differing_tokens"], unit="tokens", ratio_vs_bf16=None, tokens=d["tokens"],
                            max_abs_dlogp=d["max_abs_dlogp"], engine_start_s=job.get("start_seconds"),
                            generate_s=job.get("generate_seconds"), command=command, date=job["date"], device=device))
            agg = by_model.setdefault(shape, dict(max_abs=0.0, tokens=0, differing=0, recipes=set(), routes={}, date=job["date"]))
            agg["max_abs"] = max(agg["max_abs"], float(d["max_abs_dlogp"]))
            agg["tokens"] += d["tokens"]
            agg["differing"] += d["differing_tokens"]
            agg["recipes"].add(job["recipe"])
            agg["routes"].update(job.get("vendor_route") or {})
    for shape, agg in by_model.items():
        out.append(dict(name="bitwise_logprob_mismatch", shape=shape, backend="+".join(sorted(agg["recipes"])) + route_suffix(agg["routes"]),
                        value=agg["max_abs"], unit="max |dlogp|", ratio_vs_bf16=None, tokens_compared=agg["tokens"],
                        differing_tokens=agg["differing"], command=command, date=agg["date"], device=device))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path, help="the JETRL_RESULTS_DIR of a test_vllm_bitwise_gpu.py run")
    ap.add_argument("--device_name", default=None, help="the device, for job results that do not name it")
    ap.add_argument("--command", default=DEFAULT_COMMAND)
    ap.add_argument("--label", default="vllm-bitwise")
    a = ap.parse_args(argv)
    jobs = [json.loads(p.read_text()) for p in sorted(a.dir.glob("bitwise_*.json"))]
    recs = records_from(jobs, a.device_name, a.command)
    path = write_run(recs, a.label, recs[0]["date"])
    for r in recs:
        if r["name"] == "bitwise_logprob_mismatch":
            print(f"{r['shape']} ({r['backend']}): {r['differing_tokens']} of {r['tokens_compared']} log-prob comparisons differ, "
                  f"max |dlogp| {r['value']}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
