"""The raw bytes of one token, for chat logprobs' `bytes` field.

OpenAI's `bytes` lets a client join the bytes of the tokens that split one character between
them. `tokenizer.decode([id])` cannot give them: a token holding part of a UTF-8 character
decodes to U+FFFD. The token's vocabulary piece can: byte-level BPE vocabularies (DeepSeek's,
GPT-2's) spell each byte as one printable character, and SentencePiece byte fallback spells a
lone byte as "<0xHH>".
"""

from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: the printable Latin-1 bytes stand for
    themselves, the other 68 bytes are the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update((b, chr(0x100 + i)) for i, b in enumerate(extra))
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_level_alphabet()


def piece_bytes(piece: str | None) -> bytes | None:
    """The bytes a vocabulary piece spells (byte-level BPE or "<0xHH>"), or None when it is
    neither (a special token, a SentencePiece word piece)."""
    if not piece:
        return None
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    return None


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The raw bytes of token_id, whose decoded text is `text`: that text's UTF-8 unless it
    holds U+FFFD (part of a character), then the bytes its piece spells where it spells any."""
    if "\ufffd" in text:
        raw = piece_bytes(tokenizer.convert_ids_to_tokens(token_id))
        if raw is not None and raw.decode("utf-8", errors="replace") == text:
            return raw
    return text.encode("utf-8")
