"""Block hashing for the prefix cache (plain Python, no JAX).

Hashing: a full block's hash is ``hash_fn(u32 len(parent) | parent hash | extra | "T" | u32 n |
n int64 tokens)`` (little-endian), with ``extra`` only on a sequence's first block: the adapter id
as ``"A" + ("i" | "s") + u32 len + utf-8`` then the cache salt as ``"S" + u32 len + utf-8``. The
tags keep salt "x" apart from adapter "x"; chaining carries both into every later block, and
SHA-256 keeps the hashes stable across processes. A cached block also stores its tokens and a
link to its parent's key, and a hit must match the query's whole prefix content, so even a
colliding ``hash_fn`` can only cause misses, never a wrong hit. Two blocks may hold the same
content (two requests computed the same prefix before either was cached); the map keeps both
(``hash -> {block_id: None}``) and a lookup takes the earliest registered.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence

_U32 = struct.Struct("<I")

# A cached block's key: a plain tuple (block_hash, token_ids, parent_key, extra); parent_key is
# None on a sequence's first block, and extra (the encoded extra keys) is b"" on later blocks.
# Parent links share structure, so a prefix costs one key per block; an evicted ancestor's key
# lives on only while a cached descendant refers to it (rare: descendants are evicted first).
# Plain tuples of atomic values are untracked by the cyclic GC, so a cache of 1M keys does not
# slow collections down (a NamedTuple or dataclass stays tracked: ~1.5x the cost per commit).
_BlockKey = tuple  # (bytes, tuple[int, ...], _BlockKey | None, bytes)
_HASH, _TOKENS, _PARENT, _EXTRA = 0, 1, 2, 3


def _same_content(a: _BlockKey | None, b: _BlockKey | None) -> bool:
    """True when two keys stand for the same prefix (tokens, extra keys, all ancestors)."""
    while a is not b:  # identical objects: same content, done (the usual case)
        if (a is None or b is None or a[_HASH] != b[_HASH]
                or a[_TOKENS] != b[_TOKENS] or a[_EXTRA] != b[_EXTRA]):
            return False
        a, b = a[_PARENT], b[_PARENT]
    return True


def match_block(bucket: Iterable[int], keys: Sequence[_BlockKey | None],
                tokens: tuple[int, ...], extra: bytes, parent_key: _BlockKey | None) -> int | None:
    """The first block of `bucket` (the ids one hash maps to, earliest registered first)
    whose key in `keys` holds exactly `tokens` and `extra` after the prefix `parent_key`
    stands for; None when only the hash matched. Both cache tiers look blocks up with it."""
    for block_id in bucket:
        key = keys[block_id]
        if (key[_TOKENS] == tokens and key[_EXTRA] == extra
                and (key[_PARENT] is parent_key or _same_content(key[_PARENT], parent_key))):
            return block_id
    return None


def encode_extra_keys(cache_salt: str | None, adapter_id: str | int | None) -> bytes:
    """Canonical, domain-separated bytes of the extra keys (tag + length-prefixed value)."""
    out = b""
    if adapter_id is not None:
        if isinstance(adapter_id, bool) or not isinstance(adapter_id, str | int):
            raise ValueError(f"adapter_id must be str, int or None, got {adapter_id!r}")
        kind = b"i" if isinstance(adapter_id, int) else b"s"
        data = str(adapter_id).encode()
        out += b"A" + kind + _U32.pack(len(data)) + data
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be str or None, got {cache_salt!r}")
        data = cache_salt.encode()
        out += b"S" + _U32.pack(len(data)) + data
    return out


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class BlockHasher:
    """Chained hashes of full blocks of ``block_size`` tokens (layout: the module docstring).

    Args:
        block_size: tokens per block (>= 1).
        hash_fn: bytes -> digest; default SHA-256 (stable across processes).
    """

    __slots__ = ("block_size", "_hash_fn", "_token_struct")

    def __init__(self, block_size: int,
                 hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        self.block_size = block_size
        self._hash_fn = hash_fn or _sha256
        self._token_struct = struct.Struct(f"<I{block_size}q")

    def block_hash(self, parent_hash: bytes, token_ids: tuple[int, ...], extra: bytes) -> bytes:
        """Hash of one block given its parent's hash (b"" for a first block) and the encoded
        extra keys (b"" on every block but the first)."""
        data = (_U32.pack(len(parent_hash)) + parent_hash + extra + b"T"
                + self._token_struct.pack(len(token_ids), *token_ids))
        return self._hash_fn(data)

    def hash_blocks(self, token_ids: Sequence[int], extra: bytes) -> list[bytes]:
        """Chained hashes of every full block of ``token_ids`` (a partial tail is skipped);
        ``extra`` is ``encode_extra_keys(...)``, hashed into the first block."""
        bs, hashes = self.block_size, []
        parent = b""
        for i in range(len(token_ids) // bs):
            parent = self.block_hash(parent, tuple(token_ids[i * bs:(i + 1) * bs]),
                                     b"" if i else extra)
            hashes.append(parent)
        return hashes
