"""Prefix caching (vLLM's ``--enable-prefix-caching``): block keys, lookups, sharing, LRU eviction; prompt ids of
workloads. Read top to bottom, these tests are the cache's behaviour by example."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.core.prefix_cache import PrefixCache, block_hashes
from simulator.inputs.workload import Workload, build_workload, read_trace

BS = 16  # block size, tokens


def admit(cache: PrefixCache, rid: int, prompt_id: int, tokens: int) -> int:
    """Admit a request the way the engine does in one prefill step; returns the tokens it still has to prefill."""
    hashes = block_hashes(prompt_id, tokens, BS)
    hit = cache.hit_blocks(hashes, tokens)
    blocks = -(-tokens // BS)
    assert cache.touch_cost(hashes, hit) + blocks - hit <= cache.free_blocks, "does not fit"
    cache.acquire(rid, hashes, hit, tokens)
    cache.take(blocks - hit)
    cache.register(rid, tokens)
    return tokens - hit * BS


# --- block keys ---------------------------------------------------------------------------------------

def test_a_prompt_has_one_key_per_full_block_and_the_partial_block_has_none():
    assert len(block_hashes(7, 40, BS)) == 2  # 16 + 16 full, 8 tokens left over: not shared
    assert len(block_hashes(7, 48, BS)) == 3
    assert len(block_hashes(7, 15, BS)) == 0


def test_keys_are_plain_integers_the_same_in_every_run():
    assert list(block_hashes(3, 48, BS)) == [3 << 32, (3 << 32) + 1, (3 << 32) + 2]


def test_the_same_prompt_id_shares_its_leading_blocks_another_shares_none():
    assert list(block_hashes(7, 64, BS))[:2] == list(block_hashes(7, 40, BS))  # one stream, a shorter prompt of it
    assert not set(block_hashes(7, 64, BS)) & set(block_hashes(8, 64, BS))


# --- lookup -------------------------------------------------------------------------------------------

def test_an_empty_cache_hits_nothing():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    assert cache.lookup(block_hashes(1, 64, BS)) == 0


def test_a_computed_prompt_is_found_again_block_by_block():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=64)
    assert cache.lookup(block_hashes(1, 64, BS)) == 4
    assert cache.lookup(block_hashes(1, 100, BS)) == 4  # a longer prompt of the same stream: its first 4 blocks
    assert cache.lookup(block_hashes(2, 64, BS)) == 0


def test_hashes_are_chained_a_different_first_block_means_no_hit_on_the_second():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    a0, a1, b0 = 10, 11, 20  # keys of hand-made chains: block 1 of chain a is a1
    cache.acquire(0, [a0, a1], 0, 2 * BS)
    cache.take(2)
    cache.register(0, 2 * BS)
    assert cache.lookup([a0, a1]) == 2
    assert cache.lookup([b0, a1]) == 0  # the lookup stops at the first miss, as vLLM's does


def test_the_last_token_is_always_computed():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=64)
    hashes = block_hashes(1, 64, BS)
    assert cache.lookup(hashes) == 4
    assert cache.hit_blocks(hashes, 64) == 3  # block-aligned and fully cached: vLLM recomputes the whole last block
    assert cache.hit_blocks(block_hashes(1, 70, BS), 70) == 4  # 6 tokens past the cached blocks: all 4 reused
    assert admit(cache, rid=1, prompt_id=1, tokens=64) == 16
    assert admit(cache, rid=2, prompt_id=1, tokens=70) == 6


def test_the_partial_last_block_is_never_shared():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=40)  # blocks: 16, 16, 8 tokens
    assert cache.lookup(block_hashes(1, 48, BS)) == 2  # the third block was partial: not cached
    assert cache.cached_blocks == 2


def test_a_preempted_request_readmitted_reuses_its_own_prompt_blocks():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=40)
    cache.take(2)  # decode lookahead, 5 blocks now
    cache.release(0, 5)
    tokens = 40 + 30  # prompt + generated before the preemption
    assert cache.hit_blocks(block_hashes(1, 40, BS), tokens) == 2  # its generated tokens are recomputed


# --- reference counting -------------------------------------------------------------------------------

def test_running_requests_share_cached_blocks_counted_once_in_memory():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    assert admit(cache, rid=0, prompt_id=1, tokens=40) == 40
    assert cache.free_blocks == 97
    assert admit(cache, rid=1, prompt_id=1, tokens=40) == 8  # 2 blocks shared, its own partial block computed
    assert cache.free_blocks == 96
    assert cache.release(0, 3) == 1  # only its partial block: the 2 shared blocks stay with request 1
    assert cache.free_blocks == 97
    assert cache.lookup(block_hashes(1, 40, BS)) == 2
    assert cache.release(1, 3) == 3
    assert cache.free_blocks == 100
    assert cache.cached_blocks == 2  # free, but cached until their room is needed


def test_holding_a_free_cached_block_takes_it_from_the_free_pool():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=40)
    cache.release(0, 3)
    hashes = block_hashes(1, 40, BS)
    assert cache.touch_cost(hashes, 2) == 2  # both reused blocks are free now: reusing them costs free blocks
    assert cache.acquire(1, hashes, 2, 40) == 2
    assert cache.free_blocks == 98
    assert cache.touch_cost(hashes, 2) == 0  # now held: a third request shares them at no cost


def test_a_block_computed_twice_stays_a_duplicate_and_is_freed_as_such():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    hashes = block_hashes(1, 32, BS)
    for rid in (0, 1):  # both admitted before either registers its blocks: both miss
        cache.acquire(rid, hashes, 0, 32)
        cache.take(2)
    cache.register(0, 32)
    cache.register(1, 32)
    assert cache.cached_blocks == 2 and cache.free_blocks == 96
    assert cache.release(1, 2) == 2
    assert cache.release(0, 2) == 2
    assert cache.lookup(hashes) == 2 and cache.free_blocks == 100


# --- the free queue and LRU eviction -----------------------------------------------------------------

def test_never_used_blocks_go_first_then_the_least_recently_freed():
    cache = PrefixCache(num_blocks=6, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=32)
    admit(cache, rid=1, prompt_id=2, tokens=32)
    cache.release(0, 2)  # prompt 1 freed first: least recently used
    cache.release(1, 2)
    cache.take(2)  # the 2 never-used blocks
    assert cache.lookup(block_hashes(1, 32, BS)) == 2 and cache.lookup(block_hashes(2, 32, BS)) == 2
    cache.take(1)
    assert cache.stats.evicted_blocks == 1
    assert cache.lookup(block_hashes(1, 32, BS)) == 1  # prompt 1 lost its last block ...
    assert cache.lookup(block_hashes(2, 32, BS)) == 2  # ... prompt 2, freed later, is intact


def test_a_request_frees_its_last_blocks_to_be_evicted_first():
    cache = PrefixCache(num_blocks=4, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=64)
    cache.release(0, 4)
    cache.take(1)  # evicts block 3: it hashes the most tokens
    assert cache.lookup(block_hashes(1, 64, BS)) == 3
    cache.take(2)
    assert cache.lookup(block_hashes(1, 64, BS)) == 1


def test_uncached_blocks_are_freed_before_the_cached_ones_of_the_same_request():
    cache = PrefixCache(num_blocks=5, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=40)  # 2 cached + 1 partial
    cache.take(2)  # decode blocks
    cache.release(0, 5)
    cache.take(3)  # the partial and the 2 decode blocks: nothing cached is lost
    assert cache.stats.evicted_blocks == 0 and cache.lookup(block_hashes(1, 40, BS)) == 2


def test_reusing_a_block_refreshes_it():
    cache = PrefixCache(num_blocks=4, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=32)
    admit(cache, rid=1, prompt_id=2, tokens=32)
    cache.release(0, 2)
    cache.release(1, 2)
    admit(cache, rid=2, prompt_id=1, tokens=33)  # prompt 1 again: its 2 blocks held, 1 new block (evicts prompt 2's)
    cache.release(2, 3)  # prompt 1 is now the most recently freed
    cache.take(2)
    assert cache.lookup(block_hashes(1, 32, BS)) == 2
    assert cache.lookup(block_hashes(2, 32, BS)) == 0


def test_sync_takes_what_the_engine_allocated_without_the_cache():
    cache = PrefixCache(num_blocks=4, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=32)
    cache.release(0, 2)
    engine_free = cache.free_blocks - 3  # three decode blocks taken by the engine's own arithmetic
    cache.sync(engine_free)
    assert cache.free_blocks == engine_free == 1
    assert cache.lookup(block_hashes(1, 32, BS)) == 1  # 2 never-used, then the prompt's last block: block 0 is left


def test_taking_more_than_is_free_is_refused():
    cache = PrefixCache(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="asked for 3 blocks with 2 free"):
        cache.take(3)


# --- accounting and statistics ------------------------------------------------------------------------

def test_free_blocks_plus_held_blocks_is_the_whole_cache_under_random_traffic():
    rng = np.random.default_rng(0)
    cache = PrefixCache(num_blocks=64, block_size=BS)
    held: dict[int, int] = {}  # the engine's view: blocks each running request holds
    for rid in range(2000):
        if held and (rng.random() < 0.5 or cache.free_blocks < 8):
            victim = list(held)[int(rng.integers(len(held)))]
            cache.release(victim, held.pop(victim))
        tokens = int(rng.integers(1, 100))
        hashes = block_hashes(int(rng.integers(5)), tokens, BS)
        hit = cache.hit_blocks(hashes, tokens)
        blocks = -(-tokens // BS)
        if cache.touch_cost(hashes, hit) + blocks - hit > cache.free_blocks:
            continue
        cache.acquire(rid, hashes, hit, tokens)
        cache.take(blocks - hit)
        cache.register(rid, tokens)
        held[rid] = blocks
        shared = {key for r in cache._requests.values() for key in r.held}  # distinct cached blocks held
        own = sum(held.values()) - sum(len(r.held) for r in cache._requests.values())
        assert cache.free_blocks + len(shared) + own == 64
    assert 0 < cache.stats.hit_tokens < cache.stats.query_tokens


def test_statistics_count_queried_and_hit_tokens_and_blocks():
    cache = PrefixCache(num_blocks=100, block_size=BS)
    admit(cache, rid=0, prompt_id=1, tokens=40)
    admit(cache, rid=1, prompt_id=1, tokens=40)
    s = cache.stats
    assert (s.requests, s.query_tokens, s.hit_tokens, s.query_blocks, s.hit_blocks) == (2, 80, 32, 4, 2)
    assert s.hit_rate == 32 / 80
    assert s.as_dict()["prefix_cache_hit_rate"] == 0.4


# --- prompt ids of workloads --------------------------------------------------------------------------

def test_a_workload_without_ids_shares_nothing_and_keeps_its_old_constructor():
    w = Workload(np.zeros(3), [5, 5, 5], [1, 1, 1], "t")
    assert w.prompt_id is None
    assert w.prompt_ids().tolist() == [0, 1, 2]
    assert list(w.to_frame().columns) == ["arrival_time", "prompt_tokens", "output_tokens"]


def test_workload_prompt_ids_are_int64_read_only_and_checked():
    w = Workload(np.zeros(2), [5, 5], [1, 1], "t", prompt_id=[4, 4])
    assert w.prompt_id.dtype == np.int64 and w.prompt_ids().tolist() == [4, 4]
    with pytest.raises(ValueError):
        w.prompt_id[0] = 1
    with pytest.raises(ValueError, match="prompt_id"):
        Workload(np.zeros(2), [5, 5], [1, 1], "t", prompt_id=[1])
    with pytest.raises(ValueError, match="prompt_id"):
        Workload(np.zeros(2), [5, 5], [1, 1], "t", prompt_id=[1, -1])


def test_a_trace_with_a_prompt_id_column_is_read_with_its_ids(tmp_path: Path):
    path = tmp_path / "ids.csv"
    path.write_text("arrival_time,prompt_tokens,output_tokens,prompt_id\n0,40,2,7\n1,40,3,7\n2,64,1,9\n")
    w = read_trace(str(path))
    assert w.prompt_id.tolist() == [7, 7, 9]
    assert w.prompt_tokens.tolist() == [40, 40, 64]
    replayed = build_workload(SimConfig.of(arrival="trace", trace=str(path), rate=None, num_requests=2).workload,
                              None, None)
    assert replayed.prompt_id.tolist() == [7, 7]  # truncated with the requests
    back = tmp_path / "back.csv"
    w.to_frame().to_csv(back, index=False)
    assert read_trace(str(back)).prompt_id.tolist() == [7, 7, 9]  # round trip


def test_a_trace_without_the_column_has_no_ids(tmp_path: Path):
    path = tmp_path / "plain.csv"
    path.write_text("arrival_time,prompt_tokens,output_tokens\n0,40,2\n")
    assert read_trace(str(path)).prompt_id is None


@pytest.mark.parametrize("cell, problem", [("-1", "must be >= 0"), ("1.5", "must be a whole number"),
                                           ("", "must be a finite number")])
def test_a_bad_prompt_id_stops_with_one_line_naming_it(tmp_path: Path, cell: str, problem: str):
    path = tmp_path / "bad.csv"
    path.write_text(f"arrival_time,prompt_tokens,output_tokens,prompt_id\n0,40,2,3\n1,40,2,{cell}\n")
    with pytest.raises(UserError, match=rf"bad.csv: line 3: prompt_id {problem}"):
        read_trace(str(path))


def test_file_sampled_requests_repeat_ids_exactly_where_rows_repeat(tmp_path: Path):
    rows = [(10 * i + 3, i + 1) for i in range(8)]  # every row distinct
    path = tmp_path / "lengths.csv"
    path.write_text("prompt_tokens,output_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
    config = SimConfig.of(rate=4.0, num_requests=500, length_dist="file", length_file=str(path))
    w = build_workload(config.workload, np.random.default_rng(0), np.random.default_rng(1))
    ids = w.prompt_id
    assert ids is not None and set(ids.tolist()) == set(range(8))  # 500 draws of 8 rows: every row, repeated
    assert [rows[i] for i in ids.tolist()] == list(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist()))
    # the ids are the rows drawn, no extra draw: the same stream as before ids existed
    assert ids.tolist() == np.random.default_rng(1).integers(0, 8, 500).tolist()


def test_synthetic_lengths_share_no_prompt():
    w = build_workload(SimConfig.of(rate=4.0, num_requests=10, length_dist="lognormal").workload,
                       np.random.default_rng(0), np.random.default_rng(1))
    assert w.prompt_id is None


# --- the engine (runs once the engine is wired to the cache: EngineSpec.prefix_caching) ------------------------

def _engine_wired() -> bool:
    from simulator.core.engine import EngineSpec

    return "prefix_caching" in EngineSpec.__dataclass_fields__


engine_wired = pytest.mark.skipif(not _engine_wired(), reason="the engine does not call the prefix cache yet")


def _run(cost: str, **fields):
    from simulator.core.runner import run_simulation

    base = dict(profile=cost, rate=15.0, num_requests=300, block_size=BS, max_num_seqs=64,
                max_num_batched_tokens=1024, max_prompt_len=1024, seed=3, save_steps=True)
    return run_simulation(SimConfig.of(**{**base, **fields}))


@engine_wired
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_with_nothing_shared_prefix_caching_changes_nothing(cost_json, scheduler):
    cost = cost_json(target=0.02, per_batched_token=1e-4, prefill=0.01, per_prompt_token=1e-5, overhead=0.001)
    fields = dict(length_dist="lognormal", prompt_len=200, output_len=100, num_gpu_blocks=100_000,
                  scheduler=scheduler, policy="fixed-k", k=3, acceptance="beta")
    off, on = _run(cost, **fields), _run(cost, enable_prefix_caching=True, **fields)
    assert on.summary["prefix_cache_hit_tokens"] == 0 and on.summary["prefix_cache_query_tokens"] > 0
    assert on.requests.equals(off.requests)


@engine_wired
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_a_preempted_request_reuses_its_own_prompt_blocks(cost_json, scheduler):
    cost = cost_json(target=0.02, per_batched_token=1e-4, prefill=0.01, per_prompt_token=1e-5, overhead=0.001)
    fields = dict(length_dist="lognormal", prompt_len=200, output_len=100, num_gpu_blocks=300, scheduler=scheduler)
    off, on = _run(cost, **fields), _run(cost, enable_prefix_caching=True, **fields)
    assert off.summary["preemptions"] > 0 and on.summary["preemptions"] > 0
    assert on.summary["prefix_cache_hit_tokens"] > 0  # distinct prompts: every hit is a recompute's own prompt
    assert on.steps["kv_blocks_used"].max() <= 300
    assert on.requests["finish_time"].notna().all()


@engine_wired
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_repeated_prompts_skip_the_prefill_of_their_cached_blocks(cost_json, tmp_path, scheduler):
    cost = cost_json(target=0.02, per_batched_token=1e-4, prefill=0.01, per_prompt_token=1e-5, overhead=0.001)
    path = tmp_path / "lengths.csv"
    path.write_text("prompt_tokens,output_tokens\n" + "".join(f"{100 + 37 * i},{20 + i}\n" for i in range(10)))
    fields = dict(length_dist="file", length_file=str(path), num_gpu_blocks=100_000, scheduler=scheduler)
    off, on = _run(cost, **fields), _run(cost, enable_prefix_caching=True, **fields)
    s = on.summary
    assert on.summary["preemptions"] == 0 and 0.5 < s["prefix_cache_hit_rate"] < 1
    assert s["prefix_cache_query_tokens"] == off.steps["prefill_tokens"].sum()
    assert on.steps["prefill_tokens"].sum() == s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"]
    assert on.requests["ttft"].mean() < off.requests["ttft"].mean()


# --- blocks keyed by a trace's content hashes (Mooncake's hash_ids) --------------------------------------

def test_an_engine_block_is_keyed_by_the_trace_block_holding_its_last_token_and_where_it_ends():
    from simulator.core.prefix_cache import END_BITS, trace_block_keys

    ids = np.array([7, 9], dtype=np.int64)  # two trace blocks of 32 tokens, a prompt of 64
    assert trace_block_keys(ids, 64, 16, 32) == [7 << END_BITS | 16, 7 << END_BITS | 32, 9 << END_BITS | 16,
                                                 9 << END_BITS | 32]
    # a block size that does not divide the trace's: the 24-token block ending at 48 lies across both trace blocks
    assert trace_block_keys(ids, 64, 24, 32) == [7 << END_BITS | 24, 9 << END_BITS | 16]
    assert trace_block_keys(ids, 47, 24, 32) == [7 << END_BITS | 24]  # the partial last block has no key


def test_trace_keys_share_exactly_the_common_prefix():
    from simulator.core.prefix_cache import trace_block_keys

    a = trace_block_keys(np.array([0, 1, 2]), 1536, BS, 512)
    b = trace_block_keys(np.array([0, 1, 5]), 1536, BS, 512)  # the third block differs
    c = trace_block_keys(np.array([0, 1]), 600, BS, 512)  # a prefix of a's prompt: block 1 partial (88 tokens)
    assert a[:64] == b[:64] and not set(a[64:]) & set(b[64:])
    assert c == a[:len(c)] and len(c) == 600 // BS


def test_a_workload_with_trace_blocks_keys_its_prompts_by_them(tmp_path: Path):
    from simulator.core.prefix_cache import prompt_keys, trace_block_keys

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [3, 4]}\n'
                    '{"timestamp": 1, "input_length": 512, "output_length": 3, "hash_ids": [3]}\n')
    w = read_trace(str(path))
    keys = prompt_keys(w, BS)
    assert keys(0) == trace_block_keys(np.array([3, 4]), 600, BS, 512) and keys(1) == keys(0)[:32]
    plain = Workload(np.zeros(2), [64, 64], [1, 1], "t", prompt_id=[5, 5])
    assert list(prompt_keys(plain, BS)(1)) == list(block_hashes(5, 64, BS))


@engine_wired
def test_with_room_for_everything_the_hit_rate_is_the_infinite_cache_bound(cost_json, tmp_path):
    """A trace of conversations (each turn's prompt the previous turns plus a new block): the engine's hit rate with a
    cache that never evicts equals the leading blocks already seen, counted request by request (vLLM's
    max_cache_hit_length: the last token is computed)."""
    from simulator.core.prefix_cache import prompt_keys
    from simulator.core.runner import run_simulation

    rng = np.random.default_rng(4)
    rows, conversations = [], [[next_id] for next_id in range(5)]
    next_id = 5
    for i in range(60):
        turn = conversations[int(rng.integers(5))]
        turn.append(next_id)
        next_id += 1
        tokens = 512 * (len(turn) - 1) + int(rng.integers(1, 513))
        rows.append(f'{{"timestamp": {i * 400}, "input_length": {tokens}, "output_length": 4, "hash_ids": {turn}}}')
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(rows) + "\n")
    config = SimConfig.of(arrival="trace", trace=str(path), enable_prefix_caching=True, block_size=BS,
                          profile=cost_json(target=0.01, prefill=0.01, per_prompt_token=1e-6), num_gpu_blocks=1_000_000)
    summary = run_simulation(config).summary
    w = read_trace(str(path))
    keys, seen, hit = prompt_keys(w, BS), set(), 0
    for rid in range(len(w)):
        tokens = int(w.prompt_tokens[rid])
        for key in keys(rid)[:(tokens - 1) // BS]:
            if key not in seen:
                break
            hit += BS
        seen.update(keys(rid))
    assert summary["prefix_cache_evicted_blocks"] == 0 and hit > 0
    assert summary["prefix_cache_hit_tokens"] == hit
    assert summary["prefix_cache_hit_rate"] == hit / int(w.prompt_tokens.sum())
