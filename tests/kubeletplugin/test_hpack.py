"""HPACK and its Huffman code against RFC 7541's own examples (Appendix C) and code table (Appendix B)."""
from __future__ import annotations

import pytest

from kubeletplugin.transport import huffman
from kubeletplugin.transport.hpack import Decoder, HPACKError, decode_int, encode, encode_int


def h(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def test_huffman_codes_from_the_lengths_match_appendix_b():
    codes = huffman.canonical_codes()
    assert codes[0] == (0x1FF8, 13)
    assert codes[1] == (0x7FFFD8, 23)
    assert codes[ord(" ")] == (0x14, 6)
    assert codes[ord("0")] == (0x0, 5)
    assert codes[ord("a")] == (0x3, 5)
    assert codes[ord("~")] == (0x1FFD, 13)
    assert codes[127] == (0xFFFFFFC, 28)
    assert codes[255] == (0x3FFFFEE, 26)
    assert codes[huffman.EOS] == (0x3FFFFFFF, 30)
    assert sum(2.0 ** -n for n in huffman.CODE_LENGTHS) == 1.0     # a complete prefix code


@pytest.mark.parametrize("coded,plain", [
    ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", b"www.example.com"),          # C.4.1
    ("a8eb 1064 9cbf", b"no-cache"),                                # C.4.2
    ("25a8 49e9 5ba9 7d7f", b"custom-key"),                         # C.4.3
    ("25a8 49e9 5bb8 e8b4 bf", b"custom-value"),
    ("6402", b"302"),                                               # C.6.1
    ("aec3 771a 4b", b"private"),
    ("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff", b"Mon, 21 Oct 2013 20:13:21 GMT"),
    ("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3", b"https://www.example.com"),
    ("640e ff", b"307"),                                            # C.6.2
])
def test_huffman_decodes_the_rfc_examples(coded, plain):
    assert huffman.decode(h(coded)) == plain
    assert huffman.encode(plain) == h(coded)


def test_huffman_every_byte_round_trips():
    data = bytes(range(256))
    assert huffman.decode(huffman.encode(data)) == data


@pytest.mark.parametrize("coded,problem", [
    (b"\xfb\x00", "not all ones"),                   # ';' (8 bits), '0' (5 bits), 3 bits of zero padding
    (b"\x00", "not all ones"),                       # '0' + 3 bits of zero padding
    (b"\x07\xff", "padding of"),                     # 'a' + 11 one bits: more than 7 bits of padding
    (b"\xff\xff\xff\xff", "EOS"),                    # EOS (30 ones) inside the string
])
def test_huffman_bad_padding_and_eos_are_errors(coded, problem):
    with pytest.raises(huffman.HuffmanError, match=problem):
        huffman.decode(coded)


def test_integers_c1():
    assert encode_int(10, 5) == b"\x0a"                                       # C.1.1
    assert encode_int(1337, 5) == h("1f 9a 0a")                               # C.1.2
    assert encode_int(42, 8) == b"\x2a"                                       # C.1.3
    assert decode_int(h("1f 9a 0a"), 0, 5) == (1337, 3)
    with pytest.raises(HPACKError, match="past the end"):
        decode_int(h("1f 9a"), 0, 5)
    with pytest.raises(HPACKError, match="too large"):
        decode_int(h("1f ff ff ff ff ff 01"), 0, 5)


def test_field_representations_c2():
    d = Decoder()
    assert d.decode(h("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")) == [
        (b"custom-key", b"custom-header")]
    assert d.size == 55 and d.table == [(b"custom-key", b"custom-header")]
    d = Decoder()
    assert d.decode(h("040c 2f73 616d 706c 652f 7061 7468")) == [(b":path", b"/sample/path")]
    assert d.table == []
    assert d.decode(h("1008 7061 7373 776f 7264 0673 6563 7265 74")) == [(b"password", b"secret")]
    assert d.table == []
    assert d.decode(h("82")) == [(b":method", b"GET")]


def _requests(blocks: list[str]) -> Decoder:
    d = Decoder()
    expected = [
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"www.example.com")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"www.example.com"),
         (b"cache-control", b"no-cache")],
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/index.html"),
         (b":authority", b"www.example.com"), (b"custom-key", b"custom-value")],
    ]
    sizes = [57, 110, 164]
    for block, want, size in zip(blocks, expected, sizes):
        assert d.decode(h(block)) == want
        assert d.size == size
    return d


def test_requests_without_huffman_c3():
    d = _requests(["8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
                   "8286 84be 5808 6e6f 2d63 6163 6865",
                   "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"])
    assert d.table == [(b"custom-key", b"custom-value"), (b"cache-control", b"no-cache"),
                       (b":authority", b"www.example.com")]


def test_requests_with_huffman_c4():
    _requests(["8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
               "8286 84be 5886 a8eb 1064 9cbf",
               "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"])


RESPONSES_C5 = [
    "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3120 "
    "474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "4803 3330 37c1 c0bf",
    "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04 677a 6970 7738 "
    "666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 "
    "3630 303b 2076 6572 7369 6f6e 3d31",
]
RESPONSES_C6 = [
    "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e 919d 29ad 1718 "
    "63c7 8f0b 97c8 e9ae 82ae 43d3",
    "4883 640e ffc1 c0bf",
    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7 821d d7f2 e6c7 "
    "b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
]


@pytest.mark.parametrize("blocks", [RESPONSES_C5, RESPONSES_C6], ids=["C.5", "C.6"])
def test_responses_with_eviction(blocks):
    """Table size 256: each response evicts the oldest entries (Appendix C.5 plain, C.6 Huffman)."""
    d = Decoder(256)
    date1, date2 = b"Mon, 21 Oct 2013 20:13:21 GMT", b"Mon, 21 Oct 2013 20:13:22 GMT"
    loc = (b"location", b"https://www.example.com")
    assert d.decode(h(blocks[0])) == [(b":status", b"302"), (b"cache-control", b"private"), (b"date", date1), loc]
    assert d.size == 222
    assert d.decode(h(blocks[1])) == [(b":status", b"307"), (b"cache-control", b"private"), (b"date", date1), loc]
    assert d.size == 222 and d.table[0] == (b":status", b"307")
    cookie = b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
    assert d.decode(h(blocks[2])) == [(b":status", b"200"), (b"cache-control", b"private"), (b"date", date2), loc,
                                      (b"content-encoding", b"gzip"), (b"set-cookie", cookie)]
    assert d.size == 215
    assert d.table == [(b"set-cookie", cookie), (b"content-encoding", b"gzip"), (b"date", date2)]


def test_table_size_updates():
    d = Decoder(4096)
    d.decode(h("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572"))
    assert d.decode(b"\x20") == [] and d.table == []                # size 0 evicts everything
    with pytest.raises(HPACKError, match="exceeds"):
        d.decode(encode_int(8192, 5, 0x20))
    with pytest.raises(HPACKError, match="after a header field"):
        Decoder().decode(b"\x82\x20")


@pytest.mark.parametrize("block,problem", [
    (b"\x80", "index 0"),
    (b"\xbe", "beyond the table"),                   # 62: the dynamic table is empty
    (b"\x04\x7f", "past the end"),                   # value length 127+ with no continuation bytes
    (b"\x04\x0a/short", "runs past the end"),
    (b"\x04\x82\x00\x00", "padding"),                # Huffman value with bad padding
    (b"\x00", "string literal missing"),
])
def test_garbage_is_a_decoding_error(block, problem):
    with pytest.raises(HPACKError, match=problem):
        Decoder().decode(block)


def test_encoder_output_decodes_to_the_same_list():
    headers = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"0"),
               (b"grpc-message", b"x" * 300)]
    block = encode(headers, table_size_update=0)
    assert block[:2] == b"\x20\x88"                 # the size update first, then :status 200 from the static table
    d = Decoder()
    assert d.decode(block) == headers and d.table == []
