"""Quantize a bf16/fp32 DeepSeek checkpoint to DeepSeek-V3's block FP8 format.

    python scripts/quantize_fp8.py SRC_DIR DST_DIR [--block 128 128]

Every projection weight (attention, dense MLP, experts, shared experts) becomes float8 e4m3
plus `weight_scale_inv` (one fp32 per block); embeddings, LM head, norms and router stay as
they are. config.json gets `quantization_config` as V3/R1 ship it; tokenizer files are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from models.fp8 import is_quantized_linear, quantize  # noqa: E402
from models.loader import checkpoint_files  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128])
    a = p.parse_args()
    src, dst = Path(a.src), Path(a.dst)
    dst.mkdir(parents=True, exist_ok=True)
    block = tuple(a.block)
    n_q = 0
    for path in checkpoint_files(src):
        out = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if is_quantized_linear(name, t):
                    out[name], out[name + "_scale_inv"] = quantize(t, block)
                    n_q += 1
                else:
                    out[name] = t
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        wm = idx["weight_map"]
        for name in list(wm):
            if name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"):
                wm[name + "_scale_inv"] = wm[name]
        (dst / index.name).write_text(json.dumps(idx, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", index.name):
            shutil.copy(f, dst / f.name)
    print(f"quantized {n_q} weights to FP8 ({block[0]}x{block[1]} blocks) in {dst}")


if __name__ == "__main__":
    main()
