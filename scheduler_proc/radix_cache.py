"""The prefix cache: a radix tree of token ids over whole KV pages, shared by every request.

An edge holds a run of whole pages (their token ids and page ids). A running request locks the
path it reuses (`acquire`); pages on no locked path are evictable, least recently used leaves
first. A finished or retracted request's pages are `insert`ed; pages the tree already holds for
the same tokens come back to the caller to free. CPU only, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence


class Node:
    __slots__ = ("children", "parent", "tokens", "pages", "lock_ref", "last_access", "serial")

    def __init__(self, parent: Node | None, tokens: array, pages: array) -> None:
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the first page's tokens
        self.parent = parent
        # int32 arrays, not lists: a cache of millions of tokens costs 8 bytes a token
        self.tokens = tokens  # len(pages) * page_size token ids
        self.pages = pages
        self.lock_ref = 0  # running requests whose reused prefix passes through this node
        self.last_access = 0
        self.serial = 0  # bumped whenever the node is pushed on the eviction heap


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(None, array("i"), array("i"))
        self.root.lock_ref = 1  # never evicted
        self.num_pages = 0  # pages the tree holds
        self.num_evictable_pages = 0  # of them, on no locked path
        self.num_nodes = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, int, Node]] = []  # (last_access, serial, id, node)

    # ---------------------------------------------------------------- lookups

    def match_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of token_ids (a multiple of the page size)."""
        node, matched = self.root, 0
        while True:
            child, num_pages = self._step(node, token_ids, matched)
            if child is None:
                return matched
            matched += num_pages * self.page_size
            if num_pages < len(child.pages):
                return matched
            node = child

    def evictable_pages_on(
        self, token_ids: Sequence[int], counted: dict[int, int] | None = None
    ) -> int:
        """Evictable pages among those the cached prefix of token_ids spans (what acquiring
        it takes out of the evictable pool). counted (node id -> pages): what earlier calls
        of one decision took already, skipped and updated."""
        node, matched, pages = self.root, 0, 0
        counted = {} if counted is None else counted
        while True:
            child, num_pages = self._step(node, token_ids, matched)
            if child is None:
                return pages
            if child.lock_ref == 0:
                before = counted.get(id(child), 0)
                pages += max(num_pages - before, 0)
                counted[id(child)] = max(num_pages, before)
            matched += num_pages * self.page_size
            if num_pages < len(child.pages):
                return pages
            node = child

    def _step(self, node: Node, token_ids: Sequence[int], matched: int) -> tuple[Node | None, int]:
        """The child of node that continues token_ids at `matched`, and how many of its pages
        match (None, 0: none does). Only the slice compared is converted to int32 (a long
        prompt that matches nothing costs a dict lookup)."""
        size = self.page_size
        if len(token_ids) - matched < size:
            return None, 0
        child = node.children.get(tuple(token_ids[matched : matched + size]))
        if child is None:
            return None, 0
        edge = child.tokens
        rest = array("i", token_ids[matched : matched + len(edge)])
        if rest == edge:
            return child, len(child.pages)
        num_pages = 1  # the first page matched by the key
        while (num_pages + 1) * size <= len(rest) and (
            rest[num_pages * size : (num_pages + 1) * size]
            == edge[num_pages * size : (num_pages + 1) * size]
        ):
            num_pages += 1
        return child, num_pages

    # ---------------------------------------------------------------- locks

    def acquire(self, token_ids: Sequence[int]) -> tuple[list[int], Node]:
        """Lock the cached prefix token_ids (whole pages, all cached: len <= match_len) for a
        running request. -> (its pages in position order, the node to `release` later)."""
        if len(token_ids) % self.page_size:
            raise ValueError(f"{len(token_ids)} tokens are not whole pages of {self.page_size}")
        node, matched, pages = self.root, 0, []
        while matched < len(token_ids):
            child, num_pages = self._step(node, token_ids, matched)
            if child is None:
                raise ValueError(f"only {matched} of {len(token_ids)} tokens are cached")
            if num_pages < len(child.pages):
                child = self._split(child, num_pages)
            pages += child.pages
            matched += len(child.tokens)
            node = child
        stamp = next(self._clock)
        walk: Node | None = node
        while walk is not None and walk is not self.root:
            if walk.lock_ref == 0:
                self.num_evictable_pages -= len(walk.pages)
            walk.lock_ref += 1
            walk.last_access = stamp
            walk = walk.parent
        return pages, node

    def release(self, node: Node) -> None:
        """Undo one `acquire` that returned node."""
        stamp = next(self._clock)
        walk: Node | None = node
        while walk is not None and walk is not self.root:
            walk.lock_ref -= 1
            assert walk.lock_ref >= 0, "released more often than acquired"
            walk.last_access = stamp
            if walk.lock_ref == 0:
                self.num_evictable_pages += len(walk.pages)
                self._push_if_leaf(walk)
            walk = walk.parent

    # ---------------------------------------------------------------- insert and evict

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache pages for token_ids (len(pages) whole pages). -> the pages the tree did not
        take (it holds other pages for the same tokens): the caller frees them."""
        size = self.page_size
        if len(token_ids) != len(pages) * size:
            raise ValueError(f"{len(token_ids)} tokens for {len(pages)} pages of {size}")
        node, matched, duplicates = self.root, 0, []
        stamp = next(self._clock)
        while matched < len(token_ids):
            child, num_pages = self._step(node, token_ids, matched)
            if child is None:
                first = matched // size
                leaf = Node(node, array("i", token_ids[matched:]), array("i", pages[first:]))
                leaf.last_access = stamp
                node.children[tuple(leaf.tokens[:size])] = leaf
                self.num_nodes += 1
                self.num_pages += len(leaf.pages)
                self.num_evictable_pages += len(leaf.pages)
                self._push_if_leaf(leaf)
                return duplicates
            if num_pages < len(child.pages):
                child = self._split(child, num_pages)
            first = matched // size
            given = array("i", pages[first : first + num_pages])
            if given != child.pages:  # usually the same pages: a row returning what it reused
                duplicates += [p for p, held in zip(given, child.pages, strict=True) if p != held]
            child.last_access = stamp
            self._push_if_leaf(child)
            matched += len(child.tokens)
            node = child
        return duplicates

    def evict(self, num_pages: int) -> list[int]:
        """Free at least num_pages evictable pages (fewer if there are not that many), least
        recently used leaves first. -> the freed pages."""
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            last_access, serial, _, node = heapq.heappop(self._heap)
            if serial != node.serial or not self._is_evictable_leaf(node):
                continue  # stale entry: touched, locked or grown children since
            freed += node.pages
            self.num_pages -= len(node.pages)
            self.num_evictable_pages -= len(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.tokens[: self.page_size])]
            self.num_nodes -= 1
            node.parent = None
            if parent is not self.root and parent.lock_ref == 0:
                self._push_if_leaf(parent)
        return freed

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut node's edge after num_pages pages; -> the new upper node (the old one below)."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = Node(parent, node.tokens[:cut], node.pages[:num_pages])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[tuple(upper.tokens[: self.page_size])] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[num_pages:], upper
        upper.children[tuple(node.tokens[: self.page_size])] = node
        self.num_nodes += 1
        return upper

    def _is_evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push_if_leaf(self, node: Node) -> None:
        if self._is_evictable_leaf(node):
            node.serial += 1
            heapq.heappush(self._heap, (node.last_access, node.serial, id(node), node))
            if len(self._heap) > 2 * self.num_nodes + 64:  # drop the stale entries
                self._heap = [e for e in self._heap if e[1] == e[3].serial]
                heapq.heapify(self._heap)

    # ---------------------------------------------------------------- checks

    def all_pages(self) -> list[int]:
        pages, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            pages += node.pages
            stack += node.children.values()
        return pages

    def check(self) -> None:
        """Assert the counters agree with the tree (tests call this)."""
        pages = evictable = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert len(node.tokens) == len(node.pages) * self.page_size
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            pages += len(node.pages)
            evictable += len(node.pages) if node.lock_ref == 0 else 0
            stack += node.children.values()
        assert (pages, evictable) == (self.num_pages, self.num_evictable_pages), (
            pages,
            evictable,
            self.num_pages,
            self.num_evictable_pages,
        )
