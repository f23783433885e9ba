"""vLLM's serving behaviours in the simulated engine, by example: multi-step scheduling (``num_scheduler_steps``), the
client's ``max_concurrency``, the API front end (a profile's ``frontend`` seconds per request) and CUDA-graph padding
(``cuda_graph_sizes``). Read top to bottom, these tests are the behaviours as a vLLM user knows them.

Each case is tiny and exact: a hand-written profile where a prefill step costs PREFILL = 0.1 s and a decode step
STEP = 0.01 s whatever the batch (nothing else costs anything), requests of a 16-token prompt, and the assertions are
the run's event log (arrival, first-token and finish times of each request, the steps' seconds)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from pytest import approx

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.core.runner import run_simulation
from simulator.inputs.workload import Workload

PREFILL, STEP = 0.1, 0.01


@pytest.fixture
def profile(tmp_path):
    """Factory: a coefficient JSON (target decode STEP + per_batched_token per token, prefill PREFILL +
    prefill_per_seq per sequence; a ``frontend`` block of ``frontend`` s per request when given); returns its path."""
    counter = iter(range(1000))

    def make(per_batched_token: float = 0.0, prefill_per_seq: float = 0.0, frontend: float | None = None) -> str:
        data = {"target": {"base": STEP, "per_batched_token": per_batched_token},
                "prefill": {"base": PREFILL, "per_seq": prefill_per_seq}}
        if frontend is not None:
            data["frontend"] = {"base": frontend, "per_seq": 0.0}
        path = tmp_path / f"cost{next(counter)}.json"
        path.write_text(json.dumps(data))
        return str(path)

    return make


def run(profile: str, arrivals, outputs, prompt: int = 16, **fields):
    """Serve requests arriving at ``arrivals`` (s) with ``outputs`` tokens each under ``fields`` of SimConfig."""
    workload = Workload(arrival_time=np.asarray(arrivals, dtype=float), prompt_tokens=np.full(len(arrivals), prompt),
                        output_tokens=np.asarray(outputs), source="test")
    fields.setdefault("num_gpu_blocks", 1000)
    return run_simulation(SimConfig.of(profile=profile, rate=1.0, num_requests=len(arrivals), **fields),
                          workload=workload)


def log(result, column: str) -> list:
    """One per-request column of a run, in request order."""
    return result.requests[column].tolist()


def pressure(profile: str, **fields):
    """A busier run (200 requests over 5 s, a KV cache small enough to preempt) for comparing configs."""
    rng = np.random.default_rng(1)
    arrivals = np.sort(rng.uniform(0, 5, 200))
    return run(profile, arrivals, rng.integers(1, 60, 200), prompt=40, num_gpu_blocks=40, max_num_seqs=16, **fields)


def comparable(summary: dict) -> str:
    """A summary as text (NaN equal to NaN), without what names the run rather than describes its results."""
    return json.dumps({k: v for k, v in summary.items() if k not in ("wall_seconds", "profile", "config_hash")},
                      sort_keys=True, default=str)


def assert_same_run(a, b) -> None:
    assert comparable(a.summary) == comparable(b.summary)
    assert a.requests.equals(b.requests)


# --- multi-step scheduling (vLLM v0's --num-scheduler-steps) -------------------------------------------------------

def test_multi_step_streams_tokens_in_chunks_of_n_steps(profile):
    # two requests at t = 0 of 9 and 3 output tokens; both prefilled together, first tokens at 0.1
    one, four = (run(profile(), [0, 0], [9, 3], num_scheduler_steps=n, save_steps=True) for n in (1, 4))
    assert log(one, "first_token_time") == approx([0.1, 0.1]) and log(four, "first_token_time") == approx([0.1, 0.1])
    # step by step: every token streamed as it is decoded
    assert log(one, "finish_time") == approx([0.18, 0.12])
    assert log(one, "chunks") == [8, 2]
    assert log(one, "itl") == approx([STEP, STEP]) and log(one, "tpot") == approx([STEP, STEP])
    # 4 steps a scheduling: the 8 tokens of request 0 come in 2 chunks (0.14, 0.18); request 1's 2 tokens are
    # decoded by 0.12 but it rides along to the chunk's end, its slot computed, its tokens discarded
    assert log(four, "finish_time") == approx([0.18, 0.14])
    assert log(four, "chunks") == [2, 1]
    assert log(four, "itl") == approx([4 * STEP, 4 * STEP])  # a gap per chunk, as vLLM's client measures it
    assert log(four, "tpot") == approx([STEP, 2 * STEP])  # per token: the step time, or more for a rider
    decode = four.steps[four.steps["kind"] == "decode"]
    assert decode["batch_size"].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert decode["emitted"].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]


def test_a_request_arriving_mid_chunk_is_admitted_at_the_chunk_boundary(profile):
    # request 1 arrives at 0.115, while request 0 decodes (its first token at 0.1)
    one, four = (run(profile(), [0, 0.115], [9, 2], num_scheduler_steps=n) for n in (1, 4))
    # step by step it is prefilled after the step under way (0.11-0.12): first token 0.12 + PREFILL
    assert log(one, "first_token_time") == approx([0.1, 0.22])
    assert log(one, "ttft") == approx([0.1, 0.105])
    # 4 steps a scheduling: the chunk 0.10-0.14 runs to its end first; TTFT holds the rest of the chunk
    assert log(four, "first_token_time") == approx([0.1, 0.24])
    assert log(four, "ttft") == approx([0.1, 0.125])
    assert log(four, "finish_time") == approx([0.28, 0.28])  # chunk 0.24-0.28 holds both last tokens


@pytest.mark.parametrize("fields, message", [
    ({"num_scheduler_steps": 4, "scheduler": "chunked-prefill"}, "needs scheduler=prefill-first"),
    ({"num_scheduler_steps": 4, "policy": "fixed-k", "k": 3}, "runs without speculation"),
    ({"num_scheduler_steps": 65}, "--num-scheduler-steps (num_scheduler_steps) must be in [1, 64]"),
    ({"cuda_graph_sizes": (1, 4, 2)}, "--cuda-graph-sizes (cuda_graph_sizes) must be increasing without repeats"),
    ({"cuda_graph_sizes": (1, 2, 2)}, "--cuda-graph-sizes (cuda_graph_sizes) must be increasing without repeats"),
    ({"cuda_graph_sizes": (0, 1)}, "--cuda-graph-sizes (cuda_graph_sizes) must be whole numbers >= 1"),
    ({"max_concurrency": 0}, "--max-concurrency (max_concurrency) must be > 0"),
])
def test_the_config_refuses_what_vllm_refuses_in_one_line(fields, message):
    with pytest.raises(UserError) as refused:
        SimConfig.of(rate=1.0, num_requests=1, **fields)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


# --- the client's max_concurrency (vllm bench serve --max-concurrency) --------------------------------------------

def test_max_concurrency_is_a_closed_loop_latency_counts_from_sending(profile):
    # 5 requests at t = 0, at most 2 in flight: each later one is sent when an earlier one finishes
    closed = run(profile(), [0] * 5, [2, 4, 2, 2, 2], max_concurrency=2)
    assert log(closed, "arrival_time") == approx([0, 0, 0.11, 0.23, 0.23])  # when each was sent
    assert log(closed, "finish_time") == approx([0.11, 0.23, 0.23, 0.34, 0.34])
    # request 2, sent at 0.11 while request 1 decodes, is prefilled after the step under way (0.11-0.12)
    assert log(closed, "first_token_time") == approx([0.1, 0.1, 0.22, 0.33, 0.33])
    assert log(closed, "latency") == approx([0.11, 0.23, 0.12, 0.11, 0.11])  # from sending, not from t = 0
    events = sorted([(t, +1) for t in log(closed, "arrival_time")] + [(t, -1) for t in log(closed, "finish_time")],
                    key=lambda e: (round(e[0], 9), e[1]))  # a finish frees its place before the next is sent
    assert max(np.cumsum([d for _, d in events])) == 2
    # no limit: an open loop, all 5 sent and prefilled at once
    opened = run(profile(), [0] * 5, [2, 4, 2, 2, 2], max_concurrency=None)
    assert log(opened, "arrival_time") == [0.0] * 5
    assert log(opened, "first_token_time") == approx([0.1] * 5)


# --- the front end (a profile's frontend block: HTTP handling and tokenization) ------------------------------------

def test_a_burst_reaches_the_engine_together_after_the_front_end_handled_it(profile):
    c = 0.005  # front-end seconds per request
    result = run(profile(frontend=c), [0, 0, 0, 0, 10], [2] * 5)
    # the burst of 4 is handed over at 4c = 0.02, then prefilled together; the lone request waits only c
    assert log(result, "first_token_time") == approx([4 * c + PREFILL] * 4 + [10 + c + PREFILL])
    assert log(result, "ttft") == approx([0.12] * 4 + [0.105])
    assert log(result, "arrival_time") == [0, 0, 0, 0, 10]  # latency counts from sending, front end included


# --- CUDA-graph padding (--cuda-graph-sizes) -----------------------------------------------------------------------

def step_seconds(profile: str, batch: int, sizes: tuple[int, ...]) -> dict[str, float]:
    """Seconds of the prefill step and of the decode step of ``batch`` requests of 2 tokens arriving together."""
    steps = run(profile, [0] * batch, [2] * batch, cuda_graph_sizes=sizes, save_steps=True).steps
    assert steps["kind"].tolist() == ["prefill", "decode"]
    return dict(zip(steps["kind"], steps["seconds"]))


@pytest.mark.parametrize("batch, padded_to", [(3, 4), (4, 4), (5, 8), (8, 8), (10, 10)])
def test_a_decode_step_costs_what_the_next_captured_size_costs(profile, batch, padded_to):
    linear = profile(per_batched_token=0.001, prefill_per_seq=0.001)  # decode 0.01 + 1 ms a sequence
    graphs = step_seconds(linear, batch, (1, 2, 4, 8))
    eager = step_seconds(linear, batch, ())
    assert eager["decode"] == approx(STEP + 0.001 * batch)
    # padded to the smallest size >= batch; a batch above the largest size (8) runs eagerly at its own size
    assert graphs["decode"] == approx(STEP + 0.001 * padded_to)
    assert graphs["prefill"] == eager["prefill"] == approx(PREFILL + 0.001 * batch)  # prefill is not padded


# --- off: today's engine ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("off, on", [
    ({"num_scheduler_steps": 1}, {"num_scheduler_steps": 4}),
    ({"max_concurrency": None}, {"max_concurrency": 4}),
    ({"cuda_graph_sizes": ()}, {"cuda_graph_sizes": (1, 2, 4, 8, 16)}),
    ({"frontend": 0.0}, {"frontend": 0.002}),  # a profile's frontend block of 0 s: as if it had none
])
def test_each_behaviour_switched_off_serves_exactly_as_before(profile, off, on):
    def busy(fields):
        frontend = fields.pop("frontend", None)
        return pressure(profile(per_batched_token=0.001, frontend=frontend), **fields)

    today = busy({})
    assert_same_run(today, busy(dict(off)))
    assert comparable(busy(dict(on)).summary) != comparable(today.summary)  # (and switched on, it does change)


# --- the defaults: the demo's engine is untouched ------------------------------------------------------------------

def test_the_new_fields_are_off_by_default():
    config = SimConfig.of(rate=1.0, num_requests=1)
    assert (config.engine.num_scheduler_steps, config.engine.cuda_graph_sizes, config.workload.max_concurrency) == (
        1, (), None)


@pytest.mark.parametrize("policy", ["no-spec", "fixed-k"])
def test_the_demo_serves_as_before_with_the_new_fields_set_to_off(policy):
    from simulator.studies.demo import demo_config

    base = demo_config().replace(num_requests=60, rate=4.0, policy=policy, k=3)
    off = base.replace(num_scheduler_steps=1, cuda_graph_sizes=(), max_concurrency=None)
    assert_same_run(run_simulation(base), run_simulation(off))


def test_vllms_enable_chunked_prefill_flag_is_the_v1_scheduler(tmp_path):
    """``--enable-chunked-prefill`` (vLLM v0's flag; always on in V1) selects the chunked-prefill scheduler, and
    contradicting it with ``--scheduler prefill-first`` is one line."""
    import json

    import run_sim

    out = tmp_path / "run"
    assert run_sim.main(["simulate", "--rate", "2", "--num-requests", "5", "--enable-chunked-prefill",
                         "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["engine"]["scheduler"] == "chunked-prefill"
    assert run_sim.main(["simulate", "--rate", "2", "--num-requests", "5", "--enable-chunked-prefill",
                         "--scheduler", "prefill-first", "--out", str(tmp_path / "bad")]) == 2
