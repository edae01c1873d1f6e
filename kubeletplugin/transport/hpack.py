"""HPACK (RFC 7541): the header compression of HTTP/2.

``Decoder`` keeps a connection's dynamic table and decodes header blocks from the peer: indexed fields, literals
with and without indexing, never-indexed literals, table size updates, Huffman-coded strings. ``encode`` writes
our header blocks with static-table indexes and plain literals only, so it keeps no dynamic table (section 2.3.3
lets an encoder use as little of the table as it likes).
"""
from __future__ import annotations

from kubeletplugin.transport import huffman

Header = tuple[bytes, bytes]

# Appendix A.
STATIC_TABLE: tuple[Header, ...] = tuple((n.encode(), v.encode()) for n, v in (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""), ("accept", ""),
    ("access-control-allow-origin", ""), ("age", ""), ("allow", ""), ("authorization", ""),
    ("cache-control", ""), ("content-disposition", ""), ("content-encoding", ""), ("content-language", ""),
    ("content-length", ""), ("content-location", ""), ("content-range", ""), ("content-type", ""),
    ("cookie", ""), ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""),
    ("if-match", ""), ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
    ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""), ("location", ""), ("max-forwards", ""),
    ("proxy-authenticate", ""), ("proxy-authorization", ""), ("range", ""), ("referer", ""), ("refresh", ""),
    ("retry-after", ""), ("server", ""), ("set-cookie", ""), ("strict-transport-security", ""),
    ("transfer-encoding", ""), ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
))
ENTRY_OVERHEAD = 32          # section 4.1: an entry's size is len(name) + len(value) + 32
DEFAULT_TABLE_SIZE = 4096


class HPACKError(ValueError):
    """A header block that cannot be decoded (HTTP/2 COMPRESSION_ERROR: the connection's table is lost)."""


def decode_int(data: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """(value, next position) of the integer whose ``prefix``-bit prefix is in ``data[pos]`` (section 5.1)."""
    mask = (1 << prefix) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HPACKError("integer runs past the end of the header block")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:                       # no field we accept needs more than 2^28
            raise HPACKError("integer too large")


def encode_int(value: int, prefix: int, flags: int = 0) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((flags | value,))
    out = bytearray((flags | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_string(data: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(data):
        raise HPACKError("string literal missing at the end of the header block")
    coded = data[pos] & 0x80
    length, pos = decode_int(data, pos, 7)
    end = pos + length
    if end > len(data):
        raise HPACKError(f"string literal of {length} bytes runs past the end of the header block")
    raw = bytes(data[pos:end])
    if coded:
        try:
            raw = huffman.decode(raw)
        except huffman.HuffmanError as err:
            raise HPACKError(str(err)) from None
    return raw, end


class Decoder:
    """One direction of one connection: the peer's header blocks, in the order they were sent."""

    def __init__(self, max_table_size: int = DEFAULT_TABLE_SIZE):
        self.max_allowed = max_table_size     # what our SETTINGS_HEADER_TABLE_SIZE lets the peer use
        self.max_size = max_table_size        # what the peer last chose (size update), <= max_allowed
        self.size = 0
        self.table: list[Header] = []         # newest first: index 62 is table[0]

    def _add(self, name: bytes, value: bytes) -> None:
        entry = len(name) + len(value) + ENTRY_OVERHEAD
        self.table.insert(0, (name, value))
        self.size += entry
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            n, v = self.table.pop()
            self.size -= len(n) + len(v) + ENTRY_OVERHEAD

    def _lookup(self, index: int) -> Header:
        if index == 0:
            raise HPACKError("index 0 is not a header field")
        if index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dyn = index - len(STATIC_TABLE) - 1
        if dyn >= len(self.table):
            raise HPACKError(f"index {index} is beyond the table ({len(STATIC_TABLE) + len(self.table)} entries)")
        return self.table[dyn]

    def decode(self, block: bytes, max_list_size: int | None = None) -> list[Header]:
        """Decode one complete header block. ``max_list_size`` bounds the decoded list (section 4.1 sizes):
        beyond it, HPACKError."""
        headers: list[Header] = []
        pos, list_size, fields_seen = 0, 0, False
        while pos < len(block):
            b = block[pos]
            if b & 0x80:                                   # indexed field
                index, pos = decode_int(block, pos, 7)
                name, value = self._lookup(index)
            elif b & 0xE0 == 0x20:                         # dynamic table size update
                if fields_seen:
                    raise HPACKError("table size update after a header field")
                size, pos = decode_int(block, pos, 5)
                if size > self.max_allowed:
                    raise HPACKError(f"table size update to {size} exceeds the {self.max_allowed} allowed")
                self.max_size = size
                self._evict()
                continue
            else:
                indexing = b & 0xC0 == 0x40                # with incremental indexing; else without/never
                index, pos = decode_int(block, pos, 6 if indexing else 4)
                if index:
                    name = self._lookup(index)[0]
                else:
                    name, pos = decode_string(block, pos)
                value, pos = decode_string(block, pos)
                if indexing:
                    self._add(name, value)
            fields_seen = True
            list_size += len(name) + len(value) + ENTRY_OVERHEAD
            if max_list_size is not None and list_size > max_list_size:
                raise HPACKError(f"header list over {max_list_size} bytes")
            headers.append((name, value))
        return headers


_STATIC_FULL = {h: i + 1 for i, h in reversed(list(enumerate(STATIC_TABLE)))}
_STATIC_NAME = {h[0]: i + 1 for i, h in reversed(list(enumerate(STATIC_TABLE)))}


def encode(headers: list[Header], table_size_update: int | None = None) -> bytes:
    """A header block: static-table entries indexed, everything else a literal without indexing, no Huffman.
    ``table_size_update`` starts the block with a dynamic table size update (after the peer changed its
    SETTINGS_HEADER_TABLE_SIZE)."""
    out = bytearray()
    if table_size_update is not None:
        out += encode_int(table_size_update, 5, 0x20)
    for name, value in headers:
        full = _STATIC_FULL.get((name, value))
        if full is not None:
            out += encode_int(full, 7, 0x80)
            continue
        index = _STATIC_NAME.get(name, 0)
        out += encode_int(index, 4, 0x00)
        if not index:
            out += encode_int(len(name), 7) + name
        out += encode_int(len(value), 7) + value
    return bytes(out)
