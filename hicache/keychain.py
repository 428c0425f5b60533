"""`KeyChain`: the storage keys of the radix tree's pages, computed once per node and kept on it.

The key scheme itself (chained SHA-256 over the namespace seed, `page_keys`) is the client's
(`hicache_client.keys`): every engine, server and plugin derives the same keys.
"""

from __future__ import annotations

from hicache.radix import TreeNode
from hicache_client.keys import page_keys, request_seed


class KeyChain:
    """The digests of tree nodes' pages, computed lazily and kept on the nodes (`page_keys`).

    A node's chain continues its parent's; a root's seed is the namespace salted by the root's
    `extra_key`. Computing a node's digests computes every ancestor's that is still missing.
    """

    def __init__(self, namespace: bytes, page_size: int) -> None:
        self.namespace = namespace
        self.page_size = page_size
        self._seeds: dict[str | None, bytes] = {}

    def seed(self, extra_key: str | None) -> bytes:
        s = self._seeds.get(extra_key)
        if s is None:
            s = self._seeds[extra_key] = request_seed(self.namespace, extra_key)
        return s

    def last_digest(self, node: TreeNode) -> bytes:
        """Digest of the last page of `node` (the seed for a root)."""
        if node.parent is None:
            return self.seed(node.extra_key)
        return self.digests(node)[-1]

    def digests(self, node: TreeNode) -> list[bytes]:
        chain = []
        x = node
        while x.parent is not None and x.page_keys is None:
            chain.append(x)
            x = x.parent
        prior = self.seed(x.extra_key) if x.parent is None else x.page_keys[-1]  # type: ignore[index]
        for y in reversed(chain):
            y.page_keys = page_keys(y.key, self.page_size, prior)
            prior = y.page_keys[-1]
        assert node.page_keys is not None
        return node.page_keys

    def storage_keys(self, node: TreeNode) -> list[str]:
        """The L3 keys of `node`'s pages."""
        return [d.hex() for d in self.digests(node)]
