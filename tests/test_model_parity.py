"""Golden parity of our model + paged MLA attention against transformers' DeepSeek."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.args import EngineArgs
from engine.worker import Worker
from models.config import ModelConfig

NUM_BLOCKS, BLOCK = 96, 4  # block size 4: never a divisor of the odd lengths used below


def make_worker(path, context_chunk_tokens=8192, **kw) -> Worker:
    args = EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=NUM_BLOCKS,
                      block_size=BLOCK, **kw)
    w = Worker(args, ModelConfig.from_pretrained(path))
    w.init_kv_cache(NUM_BLOCKS, [], 256)
    w.runner.context_chunk_tokens = context_chunk_tokens
    return w


class Seqs:
    """Hands out shuffled (non-contiguous) block ids and tracks each sequence's cached length."""

    def __init__(self, seed=0):
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.ctx: dict[str, int] = {}

    def step(self, name: str, n_new: int) -> tuple[int, list[int]]:
        ctx = self.ctx.get(name, 0)
        blocks = self.blocks.setdefault(name, [])
        while len(blocks) * BLOCK < ctx + n_new:
            blocks.append(self.free.pop())
        self.ctx[name] = ctx + n_new
        return ctx, blocks


def run(worker, seqs, items):
    """items: [(name, token_ids)]; returns {name: logits [n, V]} for each item's rows."""
    ctx, blocks = zip(*(seqs.step(name, len(t)) for name, t in items))
    r = worker.runner
    batch = r.prepare([t for _, t in items], list(ctx), list(blocks), [n for n, _ in items])
    logits = r.logits(r.forward(batch))
    out, row = {}, 0
    for name, n in zip(batch.order, batch.query_lens):
        out[name] = logits[row:row + n]
        row += n
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model", ["tiny_v2", "tiny_v2_grouped", "tiny_v3"])
def test_logits_and_greedy_decode_match_transformers(model, request):
    path, hf = request.getfixturevalue(model)
    torch.manual_seed(0)
    prompt = torch.randint(2, 320, (64,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 64:].tolist()
    w, seqs = make_worker(path), Seqs()
    logits = run(w, seqs, [("a", prompt)])["a"]
    assert rel(logits, ref) < 1e-4
    tokens = [int(logits[-1].argmax())]
    for _ in range(31):  # absorbed decode path over the paged cache
        tokens.append(int(run(w, seqs, [("a", tokens[-1:])])["a"][-1].argmax()))
    assert tokens == gen


def test_routing_rules_differ(tiny_v2, tiny_v2_grouped):
    """The group-limited model must route differently, or its parity test proves nothing."""
    cfg = ModelConfig.from_pretrained(tiny_v2_grouped[0])
    assert cfg.topk_method == "group_limited_greedy" and cfg.topk_group == 1
    from models.router import Router
    torch.manual_seed(0)
    r_g, r = Router(cfg), Router(ModelConfig.from_pretrained(tiny_v2[0]))
    with torch.no_grad():
        r.weight.normal_()
        r_g.weight.copy_(r.weight)
    x = torch.randn(64, cfg.hidden_size)
    assert not torch.equal(r(x)[1].sort(-1).values, r_g(x)[1].sort(-1).values)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(tiny_v3, chunk):
    path, _ = tiny_v3
    torch.manual_seed(1)
    prompt = torch.randint(2, 320, (61,)).tolist()
    ref = run(make_worker(path), Seqs(), [("a", prompt)])["a"]
    # A small context workspace makes each continuation gather its context in several chunks.
    w, seqs = make_worker(path, context_chunk_tokens=8), Seqs(seed=chunk)
    got = torch.cat([run(w, seqs, [("a", prompt[i:i + chunk])])["a"]
                     for i in range(0, len(prompt), chunk)])
    assert rel(got, ref) < 1e-5


def test_mixed_batch_equals_requests_alone(tiny_v2):
    """Two decodes, a first chunk and a continuation chunk in one batch (given in an order the
    runner must reorder) equal each request run alone."""
    path, _ = tiny_v2
    torch.manual_seed(2)
    p = {k: torch.randint(2, 320, (n,)).tolist() for k, n in
         dict(d1=13, d2=22, first=19, cont=30).items()}
    step1 = [("d1", p["d1"]), ("d2", p["d2"]), ("cont", p["cont"][:11])]
    step2 = [("cont", p["cont"][11:]), ("d1", [5]), ("first", p["first"]), ("d2", [9])]

    w, seqs = make_worker(path), Seqs(seed=3)
    run(w, seqs, step1)
    mixed = run(w, seqs, step2)
    assert w.runner.prepare([[1], [2, 3], [4]], [0, 0, 0], [[0], [1], [2]]).order == ["0", "2", "1"]

    for name in ("d1", "d2", "first", "cont"):
        w, seqs = make_worker(path), Seqs(seed=4)
        before = [(n, t) for n, t in step1 if n == name]
        if before:
            run(w, seqs, before)
        alone = run(w, seqs, [(n, t) for n, t in step2 if n == name])[name]
        assert rel(mixed[name], alone) < 1e-5, name


@pytest.mark.parametrize("model", ["tiny_v2", "tiny_v3"])
def test_multi_token_decodes_equal_transformers(model, request):
    """Decodes of 1 + 2 tokens (the speculative shape: the decode kernel with the causal mask
    from positions) and of 1 token (padded to 3 rows) beside a prefill chunk equal transformers'
    logits of the whole sequences at those positions."""
    path, hf = request.getfixturevalue(model)
    torch.manual_seed(3)
    seqs_tok = {k: torch.randint(2, 320, (n,)).tolist() for k, n in dict(a=17, b=24, c=12, d=30).items()}
    w, seqs = make_worker(path), Seqs(seed=5)
    w.runner.decode_threshold = 3  # the 21-token continuation of "d" stays a prefill
    pre = {"a": 14, "b": 21, "c": 11, "d": 9}  # cached before the step checked
    run(w, seqs, [(k, t[:pre[k]]) for k, t in seqs_tok.items()])
    step = [("d", seqs_tok["d"][9:]), ("a", seqs_tok["a"][14:]), ("c", seqs_tok["c"][11:]),
            ("b", seqs_tok["b"][21:])]
    batch_order = w.runner.prepare([t for _, t in step], [9, 14, 11, 21], [list(range(8))] * 4, [n for n, _ in step]).order
    assert batch_order == ["a", "c", "b", "d"]  # the decodes first
    got = run(w, seqs, step)
    for k, t in seqs_tok.items():
        with torch.no_grad():
            ref = hf(torch.tensor([t])).logits[0, pre[k]:].float()
        assert rel(got[k], ref) < 1e-4, k


def _broken_copy(src, tmp_path, edit):
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def test_missing_tensor_is_named(tiny_v3, tmp_path):
    def drop(d):
        t = load_file(d / "model.safetensors")
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        save_file(t, d / "model.safetensors")
    path = _broken_copy(tiny_v3[0], tmp_path, drop)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        make_worker(path)


def test_wrong_shape_is_named(tiny_v3, tmp_path):
    def reshape(d):
        t = load_file(d / "model.safetensors")
        t["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(7, 7)
        save_file(t, d / "model.safetensors")
    path = _broken_copy(tiny_v3[0], tmp_path, reshape)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight has shape \[7, 7\], expected \[128, 32\]"):
        make_worker(path)


def test_unsupported_model_type(tiny_v3, tmp_path):
    def retype(d):
        c = json.loads((d / "config.json").read_text())
        c["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(c))
    path = _broken_copy(tiny_v3[0], tmp_path, retype)
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_pretrained(path)
