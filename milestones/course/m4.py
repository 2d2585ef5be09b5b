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
                   "walk `self._shared_edges(tokens)` from the root: an edge shared only in part is cut with "
                   "`self._split(child, same)` so the match ends at a node; stamp every node passed with "
                   "`node.last_access = next(self._clock)` and gather its blocks. Return (the blocks of the "
                   "match, its last node), ([], self.root) when nothing matches."),
          Exercise("radix_tree.py", "insert", ("RadixTree.insert",),
                   "walk from the root block by block (children are keyed by their first block's tokens); "
                   "where the tree has the tokens keep its blocks (split an edge shared in part), and where "
                   "the path ends hang `Node(tuple(tokens[i:]), list(blocks[i // block_size:]), parent=node)`, "
                   "whose blocks are new and unlocked, so they count in num_evictable_blocks. Stamp every node "
                   "passed or made (last_access). Return (the last node, the list of blocks the tree newly "
                   "took over), [] when it had every token."),
          Exercise("radix_tree.py", "lock", ("RadixTree.lock",),
                   "add one to lock_ref of the node and of every node up to the root; a node whose lock_ref "
                   "leaves 0 takes its blocks off num_evictable_blocks."),
          Exercise("radix_tree.py", "unlock", ("RadixTree.unlock",),
                   "take one off lock_ref of the node and of every node up to the root; a node whose lock_ref "
                   "returns to 0 puts its blocks back in num_evictable_blocks."),
          Exercise("radix_tree.py", "evict", ("RadixTree.evict",),
                   "take the unlocked leaves (no children, lock_ref 0) in order of last_access, oldest first; "
                   "drop each whole (out of its parent's children, its blocks off num_evictable_blocks), and "
                   "when a parent is left childless and unlocked it becomes a candidate in turn. Stop once "
                   "num_blocks blocks are released or no candidate is left; return the released blocks."))),
    Step("scheduler: match, cache, evict", ("tests/m4/test_cache_steps.py", "tests/m4/test_scheduler.py"),
         "the match is made on token_ids[:-1]; a request's whole computed blocks go into the tree at the start "
         "of every step; blocks the tree adopts gain a holder; a request that computed blocks the tree already "
         "held switches to the tree's and frees its own; a request locks the deepest node it uses and only that "
         "one; eviction, least recently used first, comes before any preemption and only if it is enough",
         (Exercise("scheduler.py", "schedule", ("Scheduler._match",),
                   "with a tree (self.tree is not None): `self.tree.match_prefix(seq.token_ids[:-1])` (never "
                   "the last token: its logits are needed), start the request's table with the matched blocks "
                   "(`self.block_manager.share(seq.request_id, blocks)`), lock the last node and keep it in "
                   "`self.locked[seq.request_id]`, and set both num_computed_tokens and num_cached_tokens to "
                   "the matched tokens."),
          Exercise("scheduler.py", "schedule", ("Scheduler._cache",),
                   "with a tree: insert the request's whole computed blocks, its first "
                   "`num_computed_tokens // block_size` blocks and their tokens, into the tree; "
                   "`self.block_manager.hold(block)` for each block insert adopted; where the tree held the "
                   "tokens first, switch the request to its blocks "
                   "(`self.block_manager.use_cached(seq.request_id, _path_blocks(node))`); lock the node insert "
                   "returned, unlock the one in self.locked and keep the new one there."),
          Exercise("scheduler.py", "schedule", ("Scheduler._make_room",),
                   "the blocks the request needs to hold num_tokens tokens "
                   "(`self.block_manager.num_new_blocks`) plus headroom: if fewer are free and the tree's "
                   "num_evictable_blocks can make up the difference, `self.tree.evict(missing)` and "
                   "`self.block_manager.release(block)` each block it returns; if not, evict nothing. Return "
                   "whether the needed blocks are free now."),)),
    Step("the engine, the same tokens as m3", ("tests/m4/test_vs_m3.py",),
         "an integrity message (every batch is checked as it is scheduled, the bookkeeping after every step) "
         "names the rule that broke: a lock lost, a reference count off, a block freed while cached; 'output "
         "token T differs' means the bookkeeping held but a request read blocks that do not hold its prefix"),
    contract("m4"),
)
# --8<-- [end:m4]
