"""m4's lesson, the radix prefix cache: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m4"]``; docs/m4.md shows its snippet section under "Build it yourself".
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m4]
STEPS: tuple[Step, ...] = (
    Step("radix tree", ("tests/m4/test_radix_tree.py",),
         "edges hold whole blocks; every match and insert stamps the nodes it passes (LRU); a node's blocks "
         "count in num_evictable_blocks exactly while its lock_ref is 0; eviction takes unlocked leaves, least "
         "recently used first",
         (Exercise("radix_tree.py", "match_prefix", ("RadixTree.match_prefix",),
                   "the longest cached prefix of tokens, in whole blocks: (its blocks, its last node), ([], "
                   "self.root) when nothing matches. An edge the tokens share only in part is cut, so that the "
                   "match ends at a node; every node passed is stamped `node.last_access = next(self._clock)`.",
                   how="walk `self._shared_edges(tokens)` from the root, which gives each (child, blocks shared); "
                   "cut with `self._split(child, same)` when fewer than the child's blocks are shared; gather "
                   "each node's blocks."),
          Exercise("radix_tree.py", "insert", ("RadixTree.insert",),
                   "add a computed prefix (whole blocks): where the tree has the tokens already it keeps its own "
                   "blocks (an edge shared in part is split), and the rest hangs below as one new node, "
                   "`Node(tuple(tokens[i:]), list(blocks[i // block_size:]), parent=node)`, whose blocks are new "
                   "and unlocked, so they count in num_evictable_blocks. Every node passed or made is stamped "
                   "(last_access). Return (the last node, the list of blocks the tree newly took over), [] when "
                   "it had every token.",
                   how="walk from the root block by block: children are keyed by their first block's tokens, "
                   "`node.children.get(tuple(tokens[i : i + self.block_size]))`; `self._common_blocks(child, "
                   "tokens, i)` counts the blocks an edge shares; move i on by the length of the node's "
                   "tokens."),
          Exercise("radix_tree.py", "lock", ("RadixTree.lock",),
                   "add one to lock_ref of the node and of every node up to the root; a node whose lock_ref "
                   "leaves 0 takes its blocks off num_evictable_blocks.",
                   how="follow node.parent until None."),
          Exercise("radix_tree.py", "unlock", ("RadixTree.unlock",),
                   "take one off lock_ref of the node and of every node up to the root; a node whose lock_ref "
                   "returns to 0 puts its blocks back in num_evictable_blocks.",
                   how="follow node.parent until None, as lock does."),
          Exercise("radix_tree.py", "evict", ("RadixTree.evict",),
                   "release at least num_blocks blocks (or every one it can): unlocked leaves (no children, "
                   "lock_ref 0) go whole, least recently used (last_access) first, each out of its parent's "
                   "children and its blocks off num_evictable_blocks; a parent left childless and unlocked "
                   "becomes a candidate in turn. Return the released blocks.",
                   how="a heap of (last_access, id(node), node) over `self._nodes()`'s leaves; pop until enough "
                   "are released or it is empty, pushing a parent that became a leaf."))),
    Step("scheduler: match, cache, evict", ("tests/m4/test_cache_steps.py", "tests/m4/test_scheduler.py"),
         "the match is made on token_ids[:-1]; a request's whole computed blocks go into the tree at the start "
         "of every step; blocks the tree adopts gain a holder; a request that computed blocks the tree already "
         "held switches to the tree's and frees its own; a request locks the deepest node it uses and only that "
         "one; eviction, least recently used first, comes before any preemption and only if it is enough",
         (Exercise("scheduler.py", "schedule", ("Scheduler._match",),
                   "with a tree (self.tree is not None; else nothing): start the request from the longest cached "
                   "prefix of its tokens but the last (its logits are needed), or from nothing if it asks for "
                   "prompt_logprobs (it computes every prompt token): its table starts with the matched blocks, "
                   "shared; the match's last node is locked and kept in `self.locked[seq.request_id]`, with the "
                   "tokens from the root to it in `self.locked_tokens[seq.request_id]`; num_computed_tokens and "
                   "num_cached_tokens are the matched tokens.",
                   how="`self.tree.match_prefix(seq.token_ids[:-1])` (or of [] for prompt_logprobs), "
                   "`self.block_manager.share(seq.request_id, blocks)`, `self.tree.lock(node)`; the matched "
                   "tokens are `len(blocks) * self.config.block_size`."),
          Exercise("scheduler.py", "schedule", ("Scheduler._cache",),
                   "with a tree: the request's whole computed blocks, its first `num_computed_tokens // "
                   "block_size` blocks and their tokens, go into the tree (nothing to do when they are no more "
                   "than self.locked_tokens counts); each block the tree adopts gains a holder; where the tree "
                   "held the tokens first, the request switches to the tree's blocks and lets its own copies go; "
                   "the request then locks the node insert returned instead of the one in self.locked, and "
                   "self.locked and self.locked_tokens say so.",
                   how="`self.tree.insert(tokens, table[:num_blocks])` with the table from "
                   "`self.block_manager.block_tables`; `self.block_manager.hold(block)` for each adopted block; "
                   "`self.block_manager.use_cached(seq.request_id, path_blocks(node))`; lock the new node before "
                   "unlocking the old one (they may share a path)."),
          Exercise("scheduler.py", "schedule", ("Scheduler._make_room",),
                   "whether the blocks the request needs to hold num_tokens tokens, plus headroom, are free; "
                   "if fewer are free and the tree's num_evictable_blocks can make up the difference, the "
                   "missing blocks are evicted first (and go back to the block manager); if eviction cannot "
                   "make up all of it, nothing is evicted.",
                   how="`self.block_manager.num_new_blocks(seq.request_id, num_tokens) + headroom`; "
                   "`self.tree.evict(missing)`, then `self.block_manager.release(block)` for each block it "
                   "returns."),)),
    Step("the engine, the same tokens as m3", ("tests/m4/test_vs_m3.py",),
         "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
         "names the rule that broke: a lock lost, a reference count off, a block freed while cached; 'output "
         "token T differs' means the bookkeeping held but a request read blocks that do not hold its prefix"),
    contract("m4"),
)
# --8<-- [end:m4]
