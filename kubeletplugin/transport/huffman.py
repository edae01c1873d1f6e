"""HPACK's Huffman code (RFC 7541 Appendix B), decoding only: our encoder sends plain literals.

The code is canonical, so the 257 code lengths of Appendix B determine it: codes of one length are consecutive,
in symbol order, and each length starts where the shorter ones left off (shifted left). Decoding walks a table
keyed by (length, code) one bit at a time: header values the kubelet sends are short, and this keeps the module
a few lines instead of a generated state machine.
"""
from __future__ import annotations

EOS = 256

# Appendix B, the "len" column, symbols 0..256 (256 is EOS).
CODE_LENGTHS: tuple[int, ...] = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,    # 0-15
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,    # 16-31
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,            # 32-47  ' ' .. '/'
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,                 # 48-63  '0' .. '?'
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,                   # 64-79  '@' .. 'O'
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,                # 80-95  'P' .. '_'
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,                   # 96-111 '`' .. 'o'
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,               # 112-127 'p' .. DEL
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,    # 128-143
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,    # 144-159
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,    # 160-175
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,    # 176-191
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,    # 192-207
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,    # 208-223
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,    # 224-239
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,    # 240-255
    30,                                                                # EOS
)


class HuffmanError(ValueError):
    """A Huffman-coded string that RFC 7541 section 5.2 calls a decoding error."""


def canonical_codes(lengths: tuple[int, ...] = CODE_LENGTHS) -> list[tuple[int, int]]:
    """(code, length) of every symbol of the canonical code with these lengths."""
    order = sorted(range(len(lengths)), key=lambda sym: (lengths[sym], sym))
    codes: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    code, prev_len = 0, lengths[order[0]]
    for i, sym in enumerate(order):
        n = lengths[sym]
        if i:
            code = (code + 1) << (n - prev_len)
        codes[sym] = (code, n)
        prev_len = n
    return codes


_CODES = canonical_codes()
_DECODE: dict[tuple[int, int], int] = {(n, code): sym for sym, (code, n) in enumerate(_CODES)}
_MAX_LEN = max(CODE_LENGTHS)


def decode(data: bytes) -> bytes:
    """Decode a Huffman-coded string literal. Padding must be fewer than 8 bits, all ones (the start of EOS),
    and EOS itself must not appear."""
    out = bytearray()
    code = n = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            n += 1
            sym = _DECODE.get((n, code))
            if sym is None:
                if n >= _MAX_LEN:
                    raise HuffmanError("Huffman code not in the table")
                continue
            if sym == EOS:
                raise HuffmanError("Huffman string contains EOS")
            out.append(sym)
            code = n = 0
    if n > 7:
        raise HuffmanError(f"Huffman padding of {n} bits (at most 7 allowed)")
    if code != (1 << n) - 1:
        raise HuffmanError("Huffman padding is not all ones")
    return bytes(out)


def encode(data: bytes) -> bytes:
    """Huffman-code ``data`` (tests use it to build inputs; the server sends plain literals)."""
    acc = bits = 0
    out = bytearray()
    for byte in data:
        code, n = _CODES[byte]
        acc, bits = (acc << n) | code, bits + n
        while bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
        acc &= (1 << bits) - 1
    if bits:
        out.append(((acc << (8 - bits)) | ((1 << (8 - bits)) - 1)) & 0xFF)
    return bytes(out)
