"""KV block bookkeeping: block tables, reference counts, the prefix cache and per-tenant quotas.

The pools themselves are `engine.kv_cache.KVCache`; this file decides which block holds what.

Blocks. Each block is in one of three states: in use (reference count > 0, in one or more sequences'
block tables), cached (count 0 but holding a full block of known content, findable by its hash and
evictable, least recently freed first), or free. A new block comes from the free list first, then by
evicting the oldest cached block.

Prefix cache. A full block's key is a hash chain:

    h_0 = sha256("lorabatch-kv-v1", tenant, adapter key (name@version), adapter content sha256, base fingerprint)
    h_i = sha256(h_{i-1}, the block's block_size token ids)

so a key names the whole prefix up to and including its block, under one tenant, adapter and base. A
new sequence looks up the chain over its full blocks and takes every leading block found (count + 1)
instead of computing it. Another tenant, another adapter, the same adapter name with new content
(vLLM issue 42125's stale KV after re-registering a LoRA under its old name) or another base give
another h_0, so their keys never meet: a hit cannot cross any of them short of a sha256 collision.
The lookup stops one token short of the sequence: the last token is always computed, since its logits
give the next token. Only full blocks are shared, and a sequence only ever writes past its last full
block, so a shared block is never written again (no copy-on-write needed).

Running example, block_size 4, prompt of 10 tokens t0..t9 already served once: blocks [t0..t3] and
[t4..t7] are cached under h_1, h_2; [t8, t9] was never full. The repeat looks up the 2 full blocks in
t0..t8, hits both, starts with 8 cached tokens and computes t8, t9 in a fresh third block.

Quotas. Every block in use belongs to the tenant whose sequences hold it (prefix sharing never
crosses tenants, so there is exactly one). A tenant may hold at most `tenant_quota` blocks; growing
past it fails with reason "quota" and the scheduler preempts that tenant's own lowest-priority
request, so one tenant flooding the engine cannot take the pool from the others. Cached blocks are
nobody's: they are evicted whenever someone needs a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheFullError

_DOMAIN = b"lorabatch-kv-v1"


def namespace_hash(tenant_id: str, adapter_key: str | None, adapter_sha: str | None, base_fingerprint: str) -> bytes:
    """h_0 of the chain (module docstring): everything a block's KV depends on besides its tokens."""
    h = hashlib.sha256(_DOMAIN)
    for part in (tenant_id, adapter_key or "", adapter_sha or "", base_fingerprint):
        data = part.encode()
        h.update(len(data).to_bytes(4, "big") + data)  # length-prefixed: ("ab", "c") and ("a", "bc") differ
    return h.digest()


def chain_hashes(prev: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of the full blocks of `tokens`, chained on `prev` (h_0 for a sequence's first block)."""
    out = []
    h_prev = prev
    for b in range(len(tokens) // block_size):
        block = array("q", tokens[b * block_size : (b + 1) * block_size]).tobytes()
        h_prev = hashlib.sha256(h_prev + block).digest()
        out.append(h_prev)
    return out


@dataclass
class _Seq:
    tenant_id: str
    namespace: bytes | None  # None: never cached (prefix caching off, or a test's bare sequence)
    table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # keys of its first len(hashes) blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, tenant_quota: int | None = None):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.tenant_quota = num_blocks if tenant_quota is None else tenant_quota
        assert 0 < self.tenant_quota <= num_blocks, (self.tenant_quota, num_blocks)
        # Popped from the end; reversed so that a fresh cache hands out blocks 0, 1, 2, ... (easy to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its key, for cached or in-use blocks that have one
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with count 0, oldest first
        self._seqs: dict[Hashable, _Seq] = {}
        self._tenant_used: dict[str, int] = {}

    # ---- queries

    @property
    def num_free(self) -> int:
        """Blocks a sequence could take now: free plus cached-but-unused."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    def tenant_blocks(self, tenant_id: str) -> int:
        return self._tenant_used.get(tenant_id, 0)

    def tenants(self) -> dict[str, int]:
        return {t: n for t, n in self._tenant_used.items() if n}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id].table

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].num_tokens

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    # ---- prefix cache

    def prefix_keys(self, namespace: bytes | None, tokens: Sequence[int]) -> list[bytes]:
        """Keys of the full blocks of tokens[:-1] (the last token is always computed); none when caching is off."""
        if not self.prefix_caching or namespace is None:
            return []
        return chain_hashes(namespace, tokens[:-1], self.block_size)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Cached blocks holding the longest leading run of `keys` (nothing is taken)."""
        hits = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_cost(self, hits: list[int], total_tokens: int) -> int:
        """Blocks leaving the free pool, and added to the tenant, to open a sequence on `hits` and grow it to
        `total_tokens`: the new blocks, plus the hits that nobody uses now."""
        return self.blocks_for(total_tokens) - len(hits) + sum(1 for b in hits if self._refs[b] == 0)

    def open(self, seq_id: Hashable, tenant_id: str, namespace: bytes | None, hits: list[int], keys: list[bytes]) -> int:
        """Start a sequence on the cached blocks `hits` (from `lookup(keys)` just before); returns its cached tokens."""
        assert seq_id not in self._seqs, f"sequence {seq_id!r} already holds blocks"
        seq = _Seq(tenant_id, namespace if self.prefix_caching else None)
        self._seqs[seq_id] = seq
        for block in hits:
            self._take(block, tenant_id)
        seq.table = list(hits)
        seq.num_tokens = len(hits) * self.block_size
        seq.hashes = list(keys[: len(hits)])
        return seq.num_tokens

    def commit(self, seq_id: Hashable, tokens: Sequence[int], num_computed: int) -> None:
        """Record the keys of the sequence's blocks that became full: tokens[:num_computed] have their KV written."""
        seq = self._seqs[seq_id]
        if seq.namespace is None:
            return
        assert num_computed <= seq.num_tokens, (num_computed, seq.num_tokens)
        start = len(seq.hashes)
        if (start + 1) * self.block_size > num_computed:
            return  # no block became full
        full = tokens[start * self.block_size : (num_computed // self.block_size) * self.block_size]
        new = chain_hashes(seq.hashes[-1] if seq.hashes else seq.namespace, full, self.block_size)
        for i, key in enumerate(new, start):
            seq.hashes.append(key)
            block = seq.table[i]
            if key not in self._block_of and block not in self._hash_of:
                self._block_of[key] = block
                self._hash_of[block] = key
            # else: the same prefix was computed twice at once; the other copy stays the cached one

    # ---- growth

    def can_grow(self, seq_id: Hashable, total_tokens: int) -> str | None:
        """None if the sequence can hold `total_tokens` tokens now, else why not: "pool" or "quota"."""
        seq = self._seqs[seq_id]
        need = self.blocks_for(total_tokens) - len(seq.table)
        if need <= 0:
            return None
        if self.tenant_blocks(seq.tenant_id) + need > self.tenant_quota:
            return "quota"
        if need > self.num_free:
            return "pool"
        return None

    def grow(self, seq_id: Hashable, total_tokens: int) -> None:
        """Make the sequence's table cover `total_tokens` tokens (check with can_grow first)."""
        seq = self._seqs[seq_id]
        why = self.can_grow(seq_id, total_tokens)
        if why is not None:
            raise KVCacheFullError(
                f"KV cache full ({why}): sequence {seq_id!r} of tenant {seq.tenant_id!r} needs "
                f"{self.blocks_for(total_tokens) - len(seq.table)} more blocks; {self.num_free} of {self.num_blocks} are "
                f"free and the tenant holds {self.tenant_blocks(seq.tenant_id)} of its quota of {self.tenant_quota}"
            )
        while len(seq.table) < self.blocks_for(total_tokens):
            seq.table.append(self._new_block(seq.tenant_id))
        seq.num_tokens = max(seq.num_tokens, total_tokens)

    def ensure(self, seq_id: Hashable, total_tokens: int, tenant_id: str = "") -> None:
        """Open (uncached) if needed and grow: for callers driving the runner directly, such as tests."""
        if seq_id not in self._seqs:
            self.open(seq_id, tenant_id, None, [], [])
        self.grow(seq_id, total_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence's hold on its blocks; freeing an unknown sequence is a no-op (abort after finish).

        Blocks with a key stay cached, the last block of the table first in line for eviction, so the
        prefixes other requests are likeliest to share are evicted last."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for block in reversed(seq.table):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, block
            if self._refs[block] == 0:
                left = self._tenant_used[seq.tenant_id] - 1
                if left:
                    self._tenant_used[seq.tenant_id] = left
                else:  # an entry per tenant ever served, each at 0, grew with every distinct tenant id
                    del self._tenant_used[seq.tenant_id]
                self._owner[block] = None
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ---- internals

    def _take(self, block: int, tenant_id: str) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
            self._owner[block] = tenant_id
            self._tenant_used[tenant_id] = self._tenant_used.get(tenant_id, 0) + 1
        assert self._owner[block] == tenant_id, (block, self._owner[block], tenant_id)
        self._refs[block] += 1

    def _new_block(self, tenant_id: str) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._take(block, tenant_id)
        return block
