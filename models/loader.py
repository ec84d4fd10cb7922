"""Load a Hugging Face DeepSeek checkpoint (safetensors) or dummy weights into our model.

The loader is a walk over the checkpoint's tensors: each name is one of our parameters, or one
`Shard` of a packed parameter (models/layers.py), and its `tp_dim` says which slice this rank
reads (only that slice is read from disk) and where in the parameter it goes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from common import distributed as pd
from models.config import ModelConfig
from models.fp8 import FP8, quantize
from models.layers import Shard, split_of

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint index names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {model_dir}")
    return files


def checkpoint_shards(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, Shard]]:
    """Every checkpoint tensor the model reads: name -> (parameter, where it goes). A parameter
    that is not packed is one checkpoint tensor of its own name."""
    out = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = pname.rpartition(".")
        shards = getattr(p, "shards", None) or [Shard(leaf, tuple(_full_shape(p)), getattr(p, "tp_dim", None), ())]
        for sh in shards:
            base, name = owner, sh.name
            while name.startswith("../"):
                base, name = base.rpartition(".")[0], name[3:]
            out[f"{base}.{name}" if base else name] = (p, sh)
    return out


def foreign_tensors(model: torch.nn.Module) -> set[str]:
    """Checkpoint tensors another rank reads and this one skips: the `foreign_tensors` (names
    relative to the module) of the MoE layers under expert parallelism (models/expert_parallel.py)."""
    return {f"{prefix}.{n}" if prefix else n for prefix, m in model.named_modules()
            for n in getattr(m, "foreign_tensors", ())}


def load_weights(model: torch.nn.Module, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Read this rank's slice of every checkpoint tensor into its place; fail with a message naming
    any bad tensor."""
    params = checkpoint_shards(model)
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    mtp = list(getattr(model, "mtp", []))
    shareable = {f"mtp.{i}.{n}" for i in range(len(mtp)) for n in ("embed_tokens.weight", "shared_head.head.weight")}
    loaded: set[str] = set()
    skipped_mtp = 0
    foreign = foreign_tensors(model)  # expert parallel: other ranks' experts
    skipped_foreign = 0
    files = checkpoint_files(model_dir)
    show = pd.tp().rank == 0
    with tqdm(desc="Loading weights", unit="tensor", disable=not show) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    bar.update(1)
                    key = name  # the tensor's name in the file; `name` becomes our parameter's
                    m = _LAYER.match(name)
                    if m and int(m.group(1)) >= cfg.num_hidden_layers:
                        i = int(m.group(1)) - cfg.num_hidden_layers
                        if i >= len(mtp):
                            skipped_mtp += 1  # multi-token-prediction layers no drafter uses
                            continue
                        name = f"mtp.{i}." + mtp[i].checkpoint_to_param(name[m.end():])
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name.endswith("weight_scale_inv") and cfg.fp8_block is None:
                        raise ValueError(f"checkpoint tensor {name}: an FP8-quantized checkpoint "
                                         "whose config.json has no quantization_config")
                    target = params.get(name)
                    if target is None and name in foreign:
                        skipped_foreign += 1
                        continue
                    if target is None:
                        log.warning("checkpoint tensor %s has no matching parameter; ignored", name)
                        continue
                    sl = f.get_slice(key)
                    if target[0].dtype == FP8 and sl.get_dtype() != "F8_E4M3":
                        loaded |= _quantize_into(params, name, sl, cfg)
                        continue
                    _copy_slice(*target, sl, name)
                    loaded.add(name)
    if skipped_foreign:
        log.info("skipped %d tensors of the routed experts other ranks hold (--enable-expert-parallel)",
                 skipped_foreign)
    if skipped_mtp:
        log.info("skipped %d tensors of multi-token-prediction layers (num_nextn_predict_layers=%d)",
                 skipped_mtp, cfg.num_nextn_predict_layers)
    for i, layer in enumerate(mtp):  # no copy in the checkpoint: the main model's, shared
        prefix = f"mtp.{i}."
        if not any(n.startswith(prefix) for n in loaded):
            raise ValueError(f"--speculative-config method mtp: checkpoint {model_dir} has no tensors of "
                             f"MTP layer model.layers.{cfg.num_hidden_layers + i}.* (config.json says "
                             f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers}); use method ngram")
        layer.share_missing(model.model.embed_tokens, model.lm_head,
                            {n[len(prefix):] for n in shareable - loaded if n.startswith(prefix)})
    missing = sorted(set(params) - loaded - shareable)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {model_dir} is missing tensor(s): {', '.join(missing[:5])}{more}")


def _quantize_into(params: dict, name: str, sl, cfg: ModelConfig) -> set[str]:
    """A higher-precision checkpoint tensor for an FP8 weight: with --quantization fp8
    (cfg.quantized_at_load), quantized to the config's blocks on the weight's device, the weight
    and its `_scale_inv` each given this rank's slice as an FP8 checkpoint's would be (whole
    blocks: check_parallel_layout keeps TP splits on block edges). The names loaded."""
    if not cfg.quantized_at_load:
        raise ValueError(f"checkpoint tensor {name} is {sl.get_dtype()} where this FP8 checkpoint's config "
                         "(quantization_config) says float8 e4m3")
    (p, sh), scale = params[name], params.get(name + "_scale_inv")
    if scale is None:
        raise ValueError(f"checkpoint tensor {name}: an FP8 weight without a scale parameter")
    q, s = quantize(sl[:].to(p.device), cfg.fp8_block)  # the full tensor: [N, K] -> blocks
    _copy_slice(p, sh, _FullTensor(q), name)
    _copy_slice(*scale, _FullTensor(s.to(scale[0].dtype)), name + "_scale_inv")
    return {name, name + "_scale_inv"}


def _copy_slice(p: torch.Tensor, sh: Shard, sl, name: str) -> None:
    """This rank's slice of checkpoint tensor `sl` (full shape `sh.shape`) into `p[sh.index]`."""
    full = list(sl.get_shape())
    if full != list(sh.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {full}, expected {list(sh.shape)}")
    vocab = getattr(p, "vocab_size", None)  # rows past it are padding
    with torch.no_grad():
        dst = p[sh.index] if sh.index else p
        if sh.tp_dim is None:
            part = sl[:]
        else:
            size, rank = split_of(p)
            n = p.shape[0] if vocab is not None else full[sh.tp_dim] // size
            start = rank * n
            stop = min(start + n, full[sh.tp_dim])
            index = [slice(None)] * len(full)
            index[sh.tp_dim] = slice(start, stop)
            part = sl[tuple(index)] if stop > start else None
        if vocab is not None:
            dst.zero_()
            if part is not None:
                dst[: part.shape[0]].copy_(part)
            return
        if sh.stack is not None:
            part = torch.stack(part.chunk(dst.shape[0], dim=sh.stack))
        if tuple(part.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint tensor {name}: this rank's slice {tuple(part.shape)} does not fit "
                             f"its place {tuple(dst.shape)}")
        dst.copy_(part)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, storage_dtype: torch.dtype | None = None) -> None:
    """Random weights of realistic scale, with no file read (for benchmarks on real configs).

    With `storage_dtype` (the dtype a checkpoint stores its tensors in, e.g. bf16), parameters the
    model keeps in fp32 (the router's weight) hold values that dtype represents, as they would when
    loaded from such a checkpoint: the router then takes the same kernels as with real weights
    (models/router.py `Router.keep_bf16_weight`).

    Each parameter's value is a function of (seed, name, full shape) only: the full tensor is
    drawn on the parameter's device from a generator seeded by a hash of these, and this rank's
    slice is taken by the checkpoint path's `_copy_slice`. So replicated parameters are equal on
    every rank and a `-tp N` dummy model is the `-tp 1` one, sharded.
    """
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, (p, sh) in checkpoint_shards(model).items():
            if name.endswith("norm.weight"):
                (p[sh.index] if sh.index else p).fill_(1.0)
                continue
            if name.endswith("e_score_correction_bias"):
                p.zero_()
                continue
            shape = list(sh.shape)
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device)
            g.manual_seed(_dummy_seed(seed, name, shape))
            fan_in = shape[-1] if len(shape) > 1 else 1
            if name.endswith("weight_scale_inv"):
                fan_in *= 128  # columns of blocks of the fp8 weight
            std = 0.02 if "embed" in name else fan_in ** -0.5
            finish = None
            if p.dtype == FP8:  # values ~N(0, 64) in fp8, scales bring them to std
                full = torch.empty(shape, device=p.device).normal_(0, 64, generator=g)
                finish = lambda t: t.clamp(-448, 448)  # noqa: E731
            elif name.endswith("weight_scale_inv"):
                full = torch.full(shape, std / 64, dtype=p.dtype, device=p.device)
            else:
                full = torch.empty(shape, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=g)
                if storage_dtype is not None and p.dtype == torch.float32 and storage_dtype != p.dtype:
                    full = full.to(storage_dtype).to(p.dtype)
            _copy_slice(p, sh, _FullTensor(full, finish), name)
            del full  # before the next tensor's draw: at V3 size each is up to ~2 GB


def _full_shape(p: torch.Tensor) -> list[int]:
    """The checkpoint shape of a parameter: this rank's slice times the TP size, unpadded vocab."""
    shape = list(p.shape)
    if getattr(p, "tp_dim", None) is not None:
        shape[p.tp_dim] *= split_of(p)[0]
    if getattr(p, "vocab_size", None) is not None:
        shape[0] = p.vocab_size
    return shape


def _dummy_seed(seed: int, name: str, shape: list[int]) -> int:
    """A generator seed from (seed, name, shape), the same in every process (unlike hash())."""
    key = f"{seed}/{name}/{'x'.join(map(str, shape))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class _FullTensor:
    """A full tensor behind the safetensors slice interface `_copy_slice` reads through;
    `finish` is applied to the slice taken (so an fp8 clamp touches only this rank's part)."""

    def __init__(self, full: torch.Tensor, finish=None):
        self.full, self.finish = full, finish

    def get_shape(self) -> list[int]:
        return list(self.full.shape)

    def __getitem__(self, index) -> torch.Tensor:
        part = self.full[index]
        return part if self.finish is None else self.finish(part)
