"""One request at a time on the real engine: target-only versus speculative decoding, the classic comparison.

:func:`serve_one` serves a single prompt alone (:class:`profiles.serving.engine.RealEngine`, arriving at time 0,
exactly ``output_len`` new tokens, greedy) under one policy and returns its latency, acceptance, step times
and the memory the run held; :func:`predict` asks the simulator for the same run.

Memory. torch counts no CPU allocations, so a run reports two figures defined by what they count (bytes):

- ``weight_bytes``: the parameters and buffers of the models the run used (the target; with a draft proposer
  also the draft), a tensor shared by both (the draft's embedding and tied head are the target's) once;
- ``peak_kv_bytes``: the largest total size of the KV-cache tensors (keys and values of every layer, of the
  target's and the draft's cache together; padding and not yet rolled-back slots included), read after
  every forward pass: a verification pass appends k + 1 slots before the rejected ones are rolled back, so
  this is the cache at its largest.

``weight_bytes + peak_kv_bytes`` is the run's model memory: what ``torch.cuda.max_memory_allocated`` would
report on a GPU, less the transient activations of a pass. The process's resident set is no measure of a
run: after a warm-up the allocator serves a run from memory the process already holds (its peak grew by
well under 1 MiB over a 100-token SmolLM2 run).

The prediction is :func:`simulator.core.runner.run_simulation` on the same one-request workload, set up as
:mod:`profiles.validation.validate` sets up its simulations: the engine's cost profile (``run_sim.py profile
--engine``), the measured acceptance replayed (``run_sim.py profile --acceptance``), no KV-block limit, the
policy pricing its choices with ``policy_profile`` (default: the profile itself); averaged over seeds of the
replay.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from transformers import Cache, PreTrainedModel

from policies.registry import make_policy
from profiles.serving.engine import RealEngineConfig, EngineResult, RealEngine
from profiles.models.pairs import ModelPair
from profiles.validation.validate import VALIDATION_PROFILE, VALIDATION_TRACE, simulation_config
from simulator.costs.cost_model import CostModel
from policies.errors import UserError
from simulator.core.runner import run_simulation
from simulator.studies.specs import parse_policy_spec
from simulator.inputs.acceptance import ConstantAcceptance
from simulator.inputs.workload import Workload

MIB = 2**20
#: Simulated figures :func:`predict` averages over seeds (seconds; acceptance rate; tokens per step).
PREDICTED = ("mean_latency", "mean_ttft", "mean_tpot", "acceptance_rate", "mean_acceptance_length")


@dataclass(frozen=True)
class SingleRun:
    """One request served alone under ``policy`` (a spec such as ``fixed-k:3``); memory in bytes."""

    policy: str
    result: EngineResult
    """The engine's run: one request row, its steps (with the timed draft and target seconds), its output."""
    weight_bytes: int
    peak_kv_bytes: int

    @property
    def output(self) -> list[int]:
        """The generated token ids."""
        return self.result.outputs[0]

    def row(self) -> dict[str, Any]:
        """The run's figures, flat: seconds, tokens, tokens/s, MiB.

        ``tokens_per_second`` is output tokens / latency (the prefill's first token included);
        ``acceptance_rate`` accepted / proposed draft tokens, ``acceptance_length`` the tokens emitted per
        speculative step, bonus token included (NaN without speculation), ``rejected_steps`` the speculative
        steps that rejected a proposed token; ``draft_passes`` the draft forward passes, ``draft_seconds`` and
        ``verify_seconds`` their and the target decode passes' timed seconds over the run, ``prefill_seconds``
        the target and draft prefills'.
        """
        request = self.result.requests.iloc[0]
        steps = self.result.steps
        decode = steps[steps["kind"] == "decode"]
        prefill = steps[steps["kind"] == "prefill"]
        summary = self.result.summary
        return {
            "policy": self.policy,
            "prompt_tokens": int(request["prompt_tokens"]),
            "output_tokens": int(request["output_tokens"]),
            "latency": float(request["latency"]),
            "ttft": float(request["ttft"]),
            "tokens_per_second": float(request["output_tokens"] / request["latency"]),
            "decode_steps": len(decode),
            "proposed_tokens": int(request["proposed_tokens"]),
            "accepted_tokens": int(request["accepted_tokens"]),
            "acceptance_rate": summary["acceptance_rate"],
            "acceptance_length": summary["mean_acceptance_length"],
            "rejected_steps": int((decode["accepted"] < decode["proposed"]).sum()),
            "draft_passes": int(decode["k_max"].sum()),
            "draft_seconds": float(decode["draft_seconds"].sum()),
            "verify_seconds": float(decode["target_seconds"].sum()),
            "prefill_seconds": float((prefill["target_seconds"] + prefill["draft_seconds"]).sum()),
            "weight_mib": self.weight_bytes / MIB,
            "peak_kv_mib": self.peak_kv_bytes / MIB,
            "model_memory_mib": (self.weight_bytes + self.peak_kv_bytes) / MIB,
        }


def one_request(prompt_tokens: int, output_len: int) -> Workload:
    """A workload of one request arriving at time 0 with ``prompt_tokens`` and ``output_len`` tokens."""
    return Workload(np.zeros(1), [prompt_tokens], np.full(1, output_len),
                    f"one request, prompt {prompt_tokens}, output {output_len}")


def policy_k(spec: str) -> tuple[str, int, dict[str, Any]]:
    """``NAME[:K][/PARAM=VALUE...]`` -> (name, k, params); ``no-spec`` needs no k (0), every other policy one."""
    name, k, params = parse_policy_spec(spec)
    if k is None and name != "no-spec":
        raise UserError(f"policy {spec!r}: give the proposal length bound, NAME:K (e.g. {name}:3)")
    return name, k or 0, dict(params)


def serve_one(pair: ModelPair, prompt: Sequence[int], output_len: int, spec: str,
              cost_model: CostModel | None = None, seed: int = 0, forward: str = "eager", cuda_graphs: bool = True,
              twin: float | None = None) -> SingleRun:
    """Serve ``prompt`` (token ids) alone for ``output_len`` tokens under policy ``spec``, greedy.

    ``cost_model``: what a policy that prices its choices (``goodput``) sees; ``seed``: the engine's rng;
    ``forward``: the engine's forward path; ``twin``: a timing twin's constant acceptance rate (tokens then
    meaningless). On the optimized path the KV cache is preallocated: its peak is its size.
    """
    name, k, params = policy_k(spec)
    acceptance = None if twin is None else ConstantAcceptance(twin, np.random.default_rng(seed + 1))
    engine = RealEngine(pair.target, pair.draft,
                        RealEngineConfig(max_num_seqs=1, max_k=k, forward=forward, cuda_graphs=cuda_graphs),
                        make_policy(name, k, params), cost_model, np.random.default_rng(seed), acceptance)
    models = [pair.target] + ([pair.draft] if engine.use_draft else [])
    with KVMeter(models) as kv:
        result = engine.run(one_request(len(prompt), output_len), [list(prompt)])
    peak = kv.peak
    if forward == "optimized":
        peak = sum(b.cache.nbytes() for b in (engine.target_kv, engine.draft_kv) if b is not None)
    return SingleRun(spec, result, weight_bytes(models), peak)


def predict(prompt_tokens: int, output_len: int, spec: str, profile: str | Path = VALIDATION_PROFILE,
            acceptance_trace: str | Path = VALIDATION_TRACE, policy_profile: str | Path | None = None,
            fitter: str = "interp", seeds: int = 10, twin: float | None = None) -> dict[str, float]:
    """The simulator's :data:`PREDICTED` figures for one request served alone (module docstring), the mean
    over ``seeds`` replays of ``acceptance_trace`` (or draws of a timing twin's constant rate ``twin``)."""
    if seeds < 1:
        raise UserError(f"predict: seeds must be >= 1 (got {seeds})")
    name, k, params = policy_k(spec)
    workload = one_request(prompt_tokens, output_len)
    config = simulation_config(workload, name, k, tuple(params.items()), profile, acceptance_trace, fitter,
                               max_num_seqs=1, policy_profile=policy_profile, twin=twin)
    summaries = [run_simulation(config.replace(seed=s), workload=workload).summary for s in range(seeds)]
    return {figure: float(np.mean([s[figure] for s in summaries])) for figure in PREDICTED}


# -- memory ----------------------------------------------------------------------------------------
def weight_bytes(models: Sequence[PreTrainedModel]) -> int:
    """Bytes of the parameters and buffers of ``models``, each tensor once (shared tensors are counted once)."""
    tensors = {}
    for model in models:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensors[tensor.data_ptr()] = tensor.nbytes
    return sum(tensors.values())


def cache_bytes(cache: Cache) -> int:
    """Bytes of a KV cache's key and value tensors, every layer."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


class KVMeter:
    """While open, the largest total of the KV-cache bytes of ``models`` (:func:`cache_bytes` of each model's
    cache after its last forward pass, summed over the models), read by forward hooks; ``peak`` is 0 until a
    pass with a cache runs."""

    def __init__(self, models: Sequence[PreTrainedModel]) -> None:
        self.models = list(models)
        self.peak = 0
        self._held: dict[int, int] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> "KVMeter":
        self._hooks = [model.register_forward_hook(self._after_pass, with_kwargs=True) for model in self.models]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _after_pass(self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache = next((value for value in kwargs.values() if isinstance(value, Cache)), None)
        if cache is not None:
            self._held[id(model)] = cache_bytes(cache)
            self.peak = max(self.peak, sum(self._held.values()))


# -- command line: the study at any scale (the prepared GPU run's ``single`` stage) --------------------
def study(pair: ModelPair, prompts: list[list[int]], output_len: int, policies: Sequence[str], profile: str,
          forward: str = "eager", cuda_graphs: bool = True, twin: float | None = None,
          acceptance_trace: str | Path = VALIDATION_TRACE, max_seconds: float | None = None) -> pd.DataFrame:
    """Each prompt served alone under each policy (prompt-major, so drift spreads over the policies), with the
    simulator's prediction beside each run: one row per run (:meth:`SingleRun.row` + ``predicted_*``)."""
    import time

    from simulator.costs.cost_model import load_cost_model

    cost = load_cost_model(profile, "interp")
    started, rows, predictions = time.monotonic(), [], {}
    serve_one(pair, prompts[0], min(output_len, 8), "fixed-k:3" if pair.draft is not None else "no-spec", cost,
              forward=forward, cuda_graphs=cuda_graphs, twin=twin)  # warm-up, not recorded
    for i, prompt in enumerate(prompts):
        for spec in policies:
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                return pd.DataFrame(rows)
            run = serve_one(pair, prompt, output_len, spec, cost, seed=i, forward=forward, cuda_graphs=cuda_graphs,
                            twin=twin)
            key = (len(prompt), spec)  # the prediction depends on the prompt's length only: once per length
            if key not in predictions:
                predictions[key] = predict(len(prompt), output_len, spec, profile, acceptance_trace, seeds=5, twin=twin)
            predicted = predictions[key]
            rows.append({"prompt": i, **run.row(), "forward": forward, "twin": twin,
                         **{f"predicted_{key}": value for key, value in predicted.items()}})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m profiles.validation.single_request``: the study on any pair, printed and written as CSV."""
    import argparse
    import sys

    from profiles.models import forward as passes
    from profiles.models.pairs import load_pair
    from profiles.validation.validate import prompt_pool
    from simulator.results import write_csv

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m profiles.validation.single_request",
                                     description="One request at a time: target alone versus speculative, measured "
                                                 "and predicted.")
    parser.add_argument("--pair", default="tiny", help="smollm2, tiny or TARGET+DRAFT model configs (default tiny)")
    parser.add_argument("--twin", type=float, metavar="RATE", help="timing twin at this constant acceptance rate")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    parser.add_argument("--dtype", default="fp32", help="bf16, fp16 or fp32 (TARGET+DRAFT pairs; default fp32)")
    parser.add_argument("--forward", default="eager", choices=("eager", "optimized"), help="default eager")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="optimized, no graphs")
    parser.add_argument("--profile", default=str(VALIDATION_PROFILE), help="the cost profile of the prediction")
    parser.add_argument("--policies", default="no-spec,fixed-k:1,fixed-k:3,fixed-k:5", help="policy specs")
    parser.add_argument("--prompt-len", type=int, help="random prompts of this many tokens (default: shipped ones)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--num-prompts", type=int, default=3, help="prompts, each served under every policy")
    parser.add_argument("--max-seconds", type=float, help="start no new run after this many seconds")
    parser.add_argument("--out", required=True, help="CSV of the runs")
    args = parser.parse_args(argv)
    try:
        if "+" in args.pair and args.twin is None:
            raise UserError(f"--pair {args.pair}: random-weight models need --twin RATE")
        device = passes.setup_device(args.device, 1 if args.device == "cpu" else None)
        pair = load_pair(args.pair, device=device, dtype=args.dtype)
        prompts = prompt_pool(pair, 0, args.prompt_len)[:args.num_prompts]
        frame = study(pair, prompts, args.output_len, [s for s in args.policies.split(",") if s], args.profile,
                      args.forward, args.cuda_graphs, args.twin, max_seconds=args.max_seconds)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_csv(Path(args.out), frame)
    shown = ["prompt", "policy", "latency", "predicted_mean_latency", "tokens_per_second", "acceptance_rate",
             "predicted_acceptance_rate", "draft_seconds", "verify_seconds", "model_memory_mib"]
    print(frame[[c for c in shown if c in frame]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
