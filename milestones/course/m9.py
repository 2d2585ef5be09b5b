"""m9's lesson, prefill/decode disaggregation: the steps a learner passes one at a time, smallest first.

``STEPS`` is ``LESSONS["m9"]``; docs/m9.md shows its snippet section under "Build it yourself".

The worker side's pieces meet in every run of a disaggregated engine: a prompt's blocks are reserved on the decode
worker, sent by the prefill worker and placed by the decode worker before any request gets past its first token. So
step 4 holds them all (the reservation, the transfer, the hand-off and the arrival, four small exercises in four
files), as m7's second step holds the check, the shrink and the trim; each step's tests pass once it and the steps
before it are written, later steps' functions still stubs.
"""

from __future__ import annotations

from milestones.course.steps import Exercise, Step, contract

# --8<-- [start:m9]
STEPS: tuple[Step, ...] = (
    Step("the router's tree", ("tests/m9/test_router.py", "-k", "tree"),
         "a prompt's prefixes of 1, 2, ... whole blocks, each known by its tokens: match walks them from the "
         "shortest and stops at the first the tree lacks; insert makes each the most recently used, then forgets the "
         "least recently used past capacity",
         (Exercise("router.py", "approximate_tree", ("ApproximateTree.match", "ApproximateTree.insert"),
                   "match(token_ids): the tokens of the longest whole-block prefix of token_ids that the tree "
                   "holds. `self._prefixes(token_ids)` are its prefixes of 1, 2, ... whole blocks, tuples, the "
                   "shortest first (none for a prompt shorter than a block); one counts only if every shorter one "
                   "is held too, so the first missing ends the walk (0 if it is the first). insert(token_ids): "
                   "every whole-block prefix of token_ids held in self.prefixes (an OrderedDict, prefix -> None, "
                   "least recently used first), each now the most recently used, then the least recently used "
                   "forgotten until at most self.capacity are held.",
                   how="match: a loop over `self._prefixes(token_ids)` that breaks at the first not in "
                   "self.prefixes, keeping `len(prefix)` of the others; insert: `self.prefixes[prefix] = None` "
                   "and `self.prefixes.move_to_end(prefix)` for each, then `self.prefixes.popitem(last=False)` "
                   "while `len(self.prefixes) > self.capacity`."),)),
    Step("the router's choice", ("tests/m9/test_router.py",),
         "round robin takes the live workers in turn; cache-aware balances loads far apart first, else takes the "
         "longest match if it holds more than CACHE_THRESHOLD of the prompt, else the smallest tree, and the chosen "
         "worker's tree learns the prompt; the decode worker is the least loaded; a dead worker is never chosen",
         (Exercise("router.py", "choose", ("Router.prefill", "Router.decode"),
                   "prefill(token_ids): `Choice(worker, reason, matched)` among the live prefill workers, "
                   "`sorted(self.alive_prefill)`, matched being the chosen worker's tree's match of token_ids. "
                   "Policy \"round_robin\": the live workers in turn (`alive[self.next % len(alive)]`, then "
                   "self.next one more), reason \"round robin\", the trees left alone. \"cache_aware\": where the "
                   "live workers' loads (self.prefill_load) are more than BALANCE_ABS_THRESHOLD apart and the "
                   "largest is more than BALANCE_REL_THRESHOLD times the smallest, the least loaded, \"balance\"; "
                   "else the worker whose tree matches the most (a tie: the least loaded), \"cache\", if that "
                   "match is more than CACHE_THRESHOLD times the prompt's length; else the worker whose tree is "
                   "smallest (`.size`; a tie: the least loaded), \"room\". Then the chosen worker's tree inserts "
                   "the prompt. decode(): the live decode worker (self.alive_decode) with the smallest "
                   "self.decode_load, the lowest number of those.",
                   how="every live worker's match computed once, before the insert changes its tree; `max(alive, "
                   "key=lambda w: (matches[w], -self.prefill_load[w]))` for the longest match, `min(alive, "
                   "key=lambda w: (self.trees[w].size, self.prefill_load[w]))` for the room; decode is `min` over "
                   "`sorted(self.alive_decode)` by load (min keeps the first of equals)."),)),
    Step("what a disaggregated engine refuses",
         ("tests/test_serve.py::test_a_flag_the_milestone_or_model_cannot_take_is_a_command_line_error",
          "tests/m9/test_vs_m8.py::test_without_workers_m9_is_m8"),
         "0 and 0 workers, in no role, is m8's one engine, accepted as it is; otherwise a worker is one process (no "
         "tensor parallelism, no torchrun), only the target's keys and values move (no draft model), a prefill "
         "worker neither guesses nor overlaps, and one trace file cannot trace several engines",
         (Exercise("config.py", "check_disaggregation", ("check_disaggregation",),
                   "raise a ValueError, before any worker starts, for what a disaggregated engine cannot run; "
                   "return None otherwise. One of config.num_prefill_workers and config.num_decode_workers 0 and "
                   "the other not: its message says \"a disaggregated engine needs at least one of each\". Both 0 "
                   "with config.disaggregation_mode \"null\": m8's one engine, nothing more to check. Otherwise "
                   "(the router, or a worker in its role): config.tensor_parallel_size other than 1, or a process "
                   "started by torchrun (`torchrun_world_size()` not None), says \"m9's workers are one process "
                   "each\"; refused too: speculative (the resolved SpeculativeConfig, or None) of method "
                   "\"draft_model\" (the draft's keys and values would have to move too); mode \"prefill\" with "
                   "speculative not None or overlap (the resolved async scheduling); config.trace_file not None.",
                   how="`workers = (config.num_prefill_workers, config.num_decode_workers)`; `min(workers) == 0 < "
                   "max(workers)` is the first refusal; then the early return, then four ifs, each raising "
                   "ValueError with its reason (the tests read the two messages quoted)."),)),
    Step("a prompt's blocks reserved, sent and placed, bit for bit",
         ("tests/m9/test_transfer.py::test_the_blocks_that_arrive_are_those_the_prefill_worker_computed",),
         "the decode worker reserves the prompt's blocks first, leaving the running requests their room; once the "
         "first token is out the prefill worker sends its own blocks with the reserved ids (before it lets them go); "
         "the decode worker writes them into exactly those blocks and runs the request from its first output token, "
         "as if it had computed the prompt. A worker that failed printed its traceback under Captured stderr "
         "(\"Process worker-N\": prefill workers first)",
         (Exercise("scheduler.py", "reserve", ("Scheduler.reserve", "Scheduler.start_decoding"),
                   "reserve(seq), on a decode worker: the blocks (a list of ids, "
                   "`self.block_manager.grow(seq.request_id, seq.num_prompt_tokens)`) that the prompt's keys and "
                   "values computed elsewhere will arrive in; None: not now. Not now while any request waits "
                   "(self.waiting: one preempted here is recomputed here, and goes first), nor while the pool "
                   "cannot hold the prompt with the blocks the running requests hold back still free: the "
                   "headroom `self.admission.held(growing, set(), self.block_manager.block_tables)`, growing being "
                   "the running requests whose step in flight does not sample their last token (not "
                   "`self._samples_its_last_token(s)`), and `self._make_room(seq, seq.num_prompt_tokens, "
                   "headroom=headroom)` says whether it fits (evicting cached blocks if that is enough). A "
                   "reserved request is in self.reserved and self.by_id, by its request id; neither waiting nor "
                   "running. start_decoding(seq): its keys and values have arrived: it leaves self.reserved and "
                   "runs (status RUNNING, in self.running) as if its prompt had been computed here: "
                   "num_computed_tokens, num_processed_tokens and spec.num_drafted_tokens are the prompt's length, "
                   "spec.num_lookahead is what add gives it (the speculative config's num_speculative_tokens, else "
                   "0), and with a prefix cache (self.tree) it locks the tree's root, the node of "
                   "`self.tree.match_prefix([])`, kept in self.locked with 0 tokens in self.locked_tokens (its "
                   "next step's _cache inserts the prompt's blocks).",
                   how="reserve: the growing list, the headroom, one `if self.waiting or not self._make_room(...)`"
                   " that returns None, the two dicts, then `return list(self.block_manager.grow(...))`. "
                   "start_decoding: `del self.reserved[seq.request_id]`, add's two lines for the lookahead, one "
                   "chained assignment for the three counts, the root locked as _match locks a node, the status, "
                   "`self.running.append(seq)`."),
          Exercise("disaggregation.py", "transfer", ("KVTransfer.send", "KVTransfer.receive", "KVTransfer.place"),
                   "send(peer, tag, blocks, destination): this pool's blocks (self.k_cache and self.v_cache are "
                   "[layers, kv heads, blocks, block_size, head_dim]), keys then values, copied into one host "
                   "tensor [2, layers, kv heads, len(blocks), block_size, head_dim] (a copy: the blocks go back to "
                   "the pool at once), sent to peer over self.group after the destination's ids (a long tensor): "
                   "the ids with tag `2 * tag`, the keys and values with `2 * tag + 1`; self.num_bytes grows by "
                   "the bytes of the keys and values; it returns `PendingTransfer(ids, kv).wait_for(works)`, works "
                   "being the two sends' works in order. receive(peer, tag, num_blocks): the matching receives "
                   "posted, into new host tensors of num_blocks long ids and of [2, layers, kv heads, num_blocks, "
                   "block_size, head_dim] in the cache's dtype, returned the same way (it counts no bytes: an "
                   "aborted request's receive is thrown away). place(received, table), once received is done: the "
                   "ids that arrived must be table (else a RuntimeError that names both); the keys go into "
                   "self.k_cache's blocks table, the values into self.v_cache's, on the cache's device, and "
                   "self.num_bytes grows by the bytes written.",
                   how="`torch.stack((self.k_cache[:, :, blocks], self.v_cache[:, :, blocks])).cpu()`; "
                   "`self.group.send([tensor], peer, tag)` and `self.group.recv([tensor], peer, tag)` return "
                   "without waiting, a Work each; receive takes its shapes from `self.k_cache.shape`; place: `kv "
                   "= received.kv.to(self.k_cache.device)`, then `self.k_cache[:, :, table] = kv[0]` and the "
                   "same for the values."),
          Exercise("disaggregation.py", "prefill_side", ("PrefillSide.hand_off",),
                   "on a prefill worker, called by the engine once a request's first token is out (and did not "
                   "end it): its binding leaves self.bound; the first len(binding.blocks) blocks of its table "
                   "here (`self.engine.scheduler.block_manager.block_tables[seq.request_id]`: the prompt's, a "
                   "partly filled last one too) are sent to binding.peer with binding.tag, for the blocks "
                   "binding.blocks reserved (self.transfer.send), the send kept in self.inflight and counted in "
                   "self.num_transfers; then the request is finished here (`self.engine.scheduler.finish(seq)`: its "
                   "full blocks stay in the prefix cache, the others are free at once), and "
                   "`Prefilled(seq.request_id, its first token, a list of seq.output_logprobs, a list of "
                   "seq.prompt_logprobs, seq.num_cached_tokens, time.perf_counter())` appended to self.notices, "
                   "for the router.",
                   how="the pop, the table's slice, `self.inflight.append(self.transfer.send(...))`, the count, "
                   "the finish, the notice: send before finish, which lets the blocks go to the next request."),
          Exercise("engine.py", "arrive", ("LLMEngine.arrive",),
                   "on a decode worker, once the prompt's keys and values are in the request's reserved blocks: "
                   "the prefill worker's log-probabilities (output_logprobs, prompt_logprobs) become the "
                   "request's, and its first token is taken as if this engine had sampled it: appended to "
                   "seq.token_ids as a pending token, then through m8's stop rules, text and metrics "
                   "(`self._accept_token`, at its index), and read by the request's grammar (seq.grammar, if it "
                   "has one: the prefill worker's grammar read it, this one has not); then the request decodes "
                   "(`self.scheduler.start_decoding(seq)`).",
                   how="the two lists set at once; `seq.token_ids.append(token)` and `seq.num_pending_tokens += 1` "
                   "(_accept_token counts it back down), `self._accept_token(seq, seq.num_tokens - 1, token)`, "
                   "`seq.grammar.accept(token)` when seq.grammar is not None, then start_decoding."))),
    Step("an abort in every state gives its blocks back", ("tests/m9/test_transfer.py",),
         "an aborted request may wait for blocks on the decode side (forget it), hold a reservation there (its "
         "blocks back at once; what the prefill worker sent, or will send, is still received and dropped, or that "
         "send never ends), or run (the engine's abort); both workers' books are checked after every step",
         (Exercise("disaggregation.py", "decode_side", ("DecodeSide.abort",),
                   "the router's Abort of a request on this decode worker. In self.prealloc (no blocks yet): "
                   "removed from it, nothing more. Not in self.transfers either (running here, or finished "
                   "already): `self.engine.abort_request(request_id)`. Reserved (its binding taken out of "
                   "self.transfers): the prefill worker may have sent its blocks, or may still: a receive already "
                   "posted (binding.received not None) goes to self.drains, to be taken and thrown away; else "
                   "`Drain(binding.peer, binding.tag, len(binding.blocks))` is kept in self.aborted under its id, "
                   "for the Prefilled that may still come (prefilled posts that receive). Either way, holding "
                   "self.engine.lock, the request finishes as aborted (`binding.seq.finish(\"abort\")`) and the "
                   "scheduler lets its reserved blocks go at once (`self.engine.scheduler.finish`).",
                   how="a loop over self.prealloc that removes the match and returns; `binding = "
                   "self.transfers.pop(request_id, None)`; an if/else for the drain; `with self.engine.lock:` "
                   "around the two finishes."),)),
    # test_faults.py (a killed worker: the router's books, no function of the lesson) runs in make test
    Step("with workers, the same tokens as m8", ("tests/m9/test_vs_m8.py",),
         "every token m8's: the first the prefill worker's, with its log-probabilities, the others decoded over keys "
         "and values bit for bit the prefill worker's. What step 4's one request did not ask for: n > 1, structured "
         "outputs (the decode worker's grammar reads the first token), prompt log-probabilities, a request whose "
         "first token is its last (its reservation given back), preemption on both sides (a request preempted on "
         "the decode worker recomputes its prompt there), guesses on the decode side (start_decoding's lookahead), "
         "two workers of each role (each request's own peer and tag)"),
    contract("m9"),
)
# --8<-- [end:m9]
