"""Incremental detokenizer tests on a small byte-level BPE tokenizer trained offline."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from common.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a naïve café.",
    "数学 is math; 数学很好 🙂🙂",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café 数学 🙂",
    "  indented   text\twith tabs\nand newlines\n",
]
# Characters absent from CORPUS are encoded as raw byte tokens: split across several tokens.
UNSEEN = "Grüße aus 日本語 🎉 and ½ more"


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def full_decode(tokenizer, ids, skip=True):
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tokenizer, ids, params=None, chunks=1, finish=True):
    """Feed ids in chunks of `chunks` tokens; return (detokenizer, deltas, stop)."""
    detok = IncrementalDetokenizer(tokenizer, [5, 6, 7], params or SamplingParams())
    deltas, stop = [], None
    for i in range(0, len(ids), chunks):
        stop = detok.update(ids[i:i + chunks])
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    if finish:
        detok.finish()
        deltas.append(detok.get_delta())
    return detok, deltas, stop


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_unseen_text_really_splits_characters(tokenizer):
    ids = encode(tokenizer, UNSEEN)
    pieces = [full_decode(tokenizer, [i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some token holds part of a character
    assert full_decode(tokenizer, ids) == UNSEEN


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_real_text_streams_without_partial_characters(tokenizer, chunks):
    text = UNSEEN + " " + CORPUS[1] + " naïve"
    ids = encode(tokenizer, text)
    detok, deltas, _ = stream(tokenizer, ids, chunks=chunks, finish=False)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_full_decode(tokenizer, skip):
    rng = random.Random(0)
    vocab = len(tokenizer)
    params = SamplingParams(skip_special_tokens=skip)
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [], params)
        deltas = []
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            assert detok.update(ids[i:i + n]) is None
            deltas.append(detok.get_delta())
            i += n
        detok.finish()
        deltas.append(detok.get_delta())
        want = full_decode(tokenizer, ids, skip)
        assert detok.output_text == want, (trial, ids)
        assert "".join(deltas) == want


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "Hello") + [tokenizer.eos_token_id] + encode(tokenizer, " world")
    assert stream(tokenizer, ids)[0].output_text == "Hello world"
    kept = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))[0].output_text
    assert kept == "Hello</s> world"


def test_window_stays_small(tokenizer):
    class Counting:
        def __init__(self, tok):
            self.tok, self.lengths = tok, []

        def decode(self, ids, **kw):
            self.lengths.append(len(ids))
            return self.tok.decode(ids, **kw)

    counting = Counting(tokenizer)
    ids = encode(tokenizer, (UNSEEN + " " + CORPUS[0] + " ") * 20)
    detok = IncrementalDetokenizer(counting, [], SamplingParams())
    for t in ids:
        detok.update([t])
    assert len(ids) > 300
    assert max(counting.lengths) <= 8  # a few tokens per update, not the whole sequence
    assert len(counting.lengths) <= 2 * len(ids)
    assert detok.output_text == full_decode(tokenizer, ids)


def test_stop_string_spanning_tokens(tokenizer):
    text = "Hello world, this is a naïve café."
    ids = encode(tokenizer, text)
    stop_str = "o wo"
    assert not any(stop_str in full_decode(tokenizer, [i]) for i in ids)  # it spans tokens
    detok, deltas, stop = stream(tokenizer, ids, SamplingParams(stop=[stop_str]))
    assert stop == stop_str and detok.stop_str == stop_str
    assert detok.output_text == "Hell" == "".join(deltas)
    assert detok.finished


def test_stop_string_with_split_characters(tokenizer):
    ids = encode(tokenizer, UNSEEN)
    detok, deltas, stop = stream(tokenizer, ids, SamplingParams(stop=["本語 🎉"]))
    assert stop == "本語 🎉"
    assert detok.output_text == "Grüße aus 日" == "".join(deltas)


def test_stop_at_the_very_start(tokenizer):
    ids = encode(tokenizer, "Hello world")
    detok, deltas, stop = stream(tokenizer, ids, SamplingParams(stop=["Hel"]))
    assert stop == "Hel"
    assert detok.output_text == ""
    assert all(d == "" for d in deltas)


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a naïve café.")
    params = SamplingParams(stop=["naïve"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tokenizer, ids, params)
    assert stop == "naïve"
    assert detok.output_text == "Hello world, this is a naïve" == "".join(deltas)


def test_multiple_stops_earliest_wins(tokenizer):
    ids = encode(tokenizer, "The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(stop=["lazy", "fox", "quick brown fox jumps"])
    for chunks in (1, 3, len(ids)):
        detok, deltas, stop = stream(tokenizer, ids, params, chunks=chunks)
        assert stop == "fox", chunks
        assert detok.output_text == "The quick brown " == "".join(deltas)


def test_earliest_completed_stop_wins_whatever_the_chunking(tokenizer):
    # "bro" completes before "quick brown" does, so a token-by-token stream stops on it first;
    # the same must happen when all the text arrives in one update
    ids = encode(tokenizer, "The quick brown fox")
    params = SamplingParams(stop=["quick brown", "bro"])
    results = {stream(tokenizer, ids, params, chunks=c)[0].output_text for c in (1, 2, len(ids))}
    assert results == {"The quick "}


def test_held_back_text_is_released_at_finish(tokenizer):
    ids = encode(tokenizer, "Hello world, this is a naïve ca")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["cafeteria", "zzz"]))
    assert detok.update(ids) is None
    assert detok.get_delta() == "Hello world, this is a naïve "  # "ca" may start "cafeteria"
    assert detok.get_delta() == ""
    detok.finish()
    assert detok.get_delta() == "ca"
    assert detok.output_text == "Hello world, this is a naïve ca"


def test_hold_back_is_only_what_could_start_a_stop(tokenizer):
    ids = encode(tokenizer, "Hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["a long stop string"]))
    detok.update(ids)
    assert detok.get_delta() == "Hello world"  # no tail of it begins the stop string


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_stop_strings_ignored_below_min_tokens(tokenizer, extra):
    """As vLLM: a stop string completed by one of the first min_tokens tokens does not count,
    one completed by the token after them does (min_tokens at, past and before the first
    "world"'s last token)."""
    ids = encode(tokenizer, "Hello world, Hello world")
    first = len(encode(tokenizer, "Hello world"))
    params = SamplingParams(stop=["world"], min_tokens=first + extra)
    detok, deltas, stop = stream(tokenizer, ids, params)
    assert stop == "world"
    want = "Hello " if extra < 0 else "Hello world, Hello "
    assert detok.output_text == want == "".join(deltas)


def test_stop_terminated_token_is_left_out(tokenizer):
    ids = encode(tokenizer, "Hello world")
    nl = encode(tokenizer, "\n")
    assert len(nl) == 1
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=nl))
    detok.update(ids[:-1])
    detok.update(ids[-1:] + nl, stop_terminated=True)
    detok.finish()
    assert detok.output_text == "Hello world"
    assert detok.token_ids == ids + nl
    params = SamplingParams(stop_token_ids=nl, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    detok.update(ids + nl, stop_terminated=True)
    assert detok.output_text == "Hello world\n"


def test_updates_after_stop_are_ignored(tokenizer):
    ids = encode(tokenizer, "Hello world")
    detok, _, stop = stream(tokenizer, ids, SamplingParams(stop=["lo"]), finish=False)
    assert stop == "lo"
    assert detok.update(encode(tokenizer, " more lo")) is None
    assert detok.output_text == "Hel"


def test_trailing_partial_character_flushed_at_finish(tokenizer):
    ids = encode(tokenizer, "ok 🎉")
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:-1])  # the emoji is incomplete
    assert detok.get_delta() == "ok "
    detok.finish()
    assert detok.get_delta() == full_decode(tokenizer, ids[:-1])[3:]
    assert detok.output_text == full_decode(tokenizer, ids[:-1])


def _sentencepiece_like():
    """Llama-style: "▁" for spaces, byte-fallback tokens, the first leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "w", "r", "d", "H", "e", "l", "o", "a", "é", "▁w", "or", "ld", "▁Hello"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[("▁", "w"), ("o", "r"), ("l", "d")],
                       byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_sentencepiece_like_decoder_streams_real_text():
    tokenizer = _sentencepiece_like()
    assert full_decode(tokenizer, encode(tokenizer, " Hello world")) == " Hello world"
    rng = random.Random(3)
    alphabet = list("Hello wrdé数日本🎉 ½")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 20)))
        ids = encode(tokenizer, text)
        detok, deltas, _ = stream(tokenizer, ids, chunks=rng.randrange(1, 4))
        assert detok.output_text == full_decode(tokenizer, ids) == "".join(deltas), text
        assert all("\ufffd" not in d for d in deltas)


def _byte_fallback(decoder: str):
    """The SentencePiece-like vocabulary with another byte-fallback decoder: "strip" (Llama),
    "nostrip" (Gemma: no leading-space strip) or "metaspace" (Metaspace decoder after the bytes)."""
    tok = _sentencepiece_like()
    inner = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    if decoder == "nostrip":
        inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    elif decoder == "metaspace":
        inner.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _byte_id(b: int) -> int:
    return 3 + b  # _sentencepiece_like's <0xNN> pieces


def test_invalid_byte_run_streams_as_its_full_decode():
    # "中" is complete after three bytes, but a fourth byte makes the run invalid: the full decode
    # replaces all four bytes, so "中" must not have been streamed
    tokenizer = _sentencepiece_like()
    ids = [_byte_id(b) for b in (0xE4, 0xB8, 0xAD, 0xE4)] + tokenizer.convert_tokens_to_ids(["▁", "a"])
    want = full_decode(tokenizer, ids)
    assert want == "\ufffd" * 4 + " a"
    detok, deltas, _ = stream(tokenizer, ids)
    assert detok.output_text == want == "".join(deltas)
    assert deltas[2] == ""  # "中" held back while the run may go on


@pytest.mark.parametrize("decoder", ["strip", "nostrip", "metaspace"])
@pytest.mark.parametrize("skip", [True, False])
def test_random_byte_fallback_streams_match_full_decode(decoder, skip):
    """Random streams heavy in byte tokens (UTF-8 lead, continuation and ASCII bytes, whole
    characters, specials between bytes), fed in random chunks, equal the full decode."""
    tokenizer = _byte_fallback(decoder)
    rng = random.Random(11)
    pieces = [i for i in range(259, len(tokenizer))]
    specials = [0, 1, 2]
    chars = ["中", "é", "🎉", "½", "a"]
    params = SamplingParams(skip_special_tokens=skip)
    for trial in range(1500):
        ids, length = [], rng.randrange(1, 24)
        while len(ids) < length:
            r = rng.random()
            if r < 0.25:
                ids += [_byte_id(b) for b in rng.choice(chars).encode()][: rng.randrange(1, 5)]
            elif r < 0.55:
                ids.append(_byte_id(rng.choice([0x20, 0x41, rng.randrange(0x80, 0xC0),
                                                rng.randrange(0xC2, 0xF5), rng.randrange(256)])))
            elif r < 0.9:
                ids.append(rng.choice(pieces))
            else:
                ids.append(rng.choice(specials))
        detok = IncrementalDetokenizer(tokenizer, [], params)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            detok.update(ids[i:i + n])
            deltas.append(detok.get_delta())
            i += n
        detok.finish()
        deltas.append(detok.get_delta())
        want = full_decode(tokenizer, ids, skip)
        assert detok.output_text == want, (trial, ids)
        assert "".join(deltas) == want, (trial, ids)


def test_byte_level_bpe_has_no_byte_fallback_tokens(tokenizer):
    from engine.detokenizer import _byte_token_ids
    assert _byte_token_ids(tokenizer) == frozenset()
    assert _byte_token_ids(_sentencepiece_like()) == frozenset(range(3, 259))


def test_stop_string_in_a_byte_run_flushed_at_finish():
    # "A" arrives as the byte token <0x41>, the last of a run held back until the run ends; the
    # run ends only with the output, so the stop string is found when finish() flushes it
    tokenizer = _sentencepiece_like()
    ids = tokenizer.convert_tokens_to_ids(["▁Hello"]) + [_byte_id(b) for b in b" AB"]
    assert full_decode(tokenizer, ids) == "Hello AB"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["A"]))
    assert detok.update(ids) is None
    assert detok.get_delta() == "Hello"
    assert detok.finish() == "A" and detok.stop_str == "A"
    assert detok.output_text == "Hello " and detok.get_delta() == " "


def test_output_processor_reports_a_stop_found_at_finish():
    from engine.output_processor import OutputProcessor
    from scheduler.outputs import EngineCoreOutput

    tokenizer = _sentencepiece_like()
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["▁Hello"]) + [_byte_id(b) for b in b" AB"]
    children = proc.add_request("r", None, [5, 6], SamplingParams(stop=["A"], max_tokens=len(ids)))
    cid = children[0][0]
    outs, _ = proc.process([EngineCoreOutput(cid, ids[:-1]), EngineCoreOutput(cid, ids[-1:], finish_reason="length")])
    c = outs[-1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("Hello ", "stop", "A")
