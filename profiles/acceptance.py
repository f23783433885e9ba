"""Measured acceptance of a real draft/target pair: the simulator's replay trace, and quick greedy figures.

``python run_sim.py profile --acceptance --out profiles/data/acceptance__smollm2.csv`` serves every shipped
prompt (:func:`profiles.models.pairs.read_prompts`) with the real engine (:mod:`profiles.serving.engine`), all
arriving at once, under ``fixed-k`` speculation with the draft, and writes each request's verification steps
as ``request_id,proposed,accepted`` rows in step order: the format :class:`simulator.inputs.acceptance.ReplayAcceptance`
replays. It then prints :func:`simulator.inputs.acceptance.fit_acceptance`'s figures (pooled rate, Beta, per
position). With ``k`` as large as the simulation will ask for, the replayed streams hold every token's
accept/reject bit (the replay reads a stream recorded with k = 5 at any k <= 5).

Without running the engine, :func:`agreement_bits` and :func:`greedy_acceptance` give greedy acceptance
from one teacher-forced draft pass over the target's greedy answer: under greedy verification the draft's
token at position t is accepted iff the draft's argmax there equals the target's token, so the bits decide
every step whatever k is (:mod:`profiles.train_draft` reports them).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from policies.registry import make_policy
from profiles.serving.engine import EngineConfig, EngineResult, RealEngine
from profiles.models.pairs import ModelPair, encode_prompts, read_prompts
from simulator.inputs.acceptance import fit_acceptance, read_acceptance_trace
from policies.errors import UserError
from simulator.costs.profile_table import write_atomic
from simulator.inputs.workload import Workload

TRACE_COLUMNS = ["request_id", "proposed", "accepted"]


@torch.inference_mode()
def agreement_bits(draft: torch.nn.Module, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Bit j: whether the draft's argmax after ``prompt + answer[:j + 1]`` is ``answer[j + 1]`` (teacher forced)."""
    n = len(answer) - 1
    ids = torch.tensor([prompt + answer[:-1]])
    logits = draft(input_ids=ids, logits_to_keep=n).logits[0]
    return (logits.argmax(dim=-1) == torch.tensor(answer[1:])).numpy()


def greedy_acceptance(bits: np.ndarray, k: int) -> tuple[int, int, int]:
    """Steps of greedy speculation with ``k`` proposed tokens over agreement ``bits``: (accepted tokens, steps
    that ended in a rejection, steps). A step at bit s accepts the leading ones of ``bits[s:s + k]`` and emits
    one more token (the correction or bonus), so the next step starts ``accepted + 1`` bits later."""
    accepted = rejections = steps = s = 0
    while s < len(bits):
        window = bits[s:s + k]
        a = int(np.argmin(window)) if not window.all() else len(window)
        accepted += a
        rejections += a < len(window)
        steps += 1
        s += a + 1
    return accepted, rejections, steps


def shipped_workload(tokenizer: object, output_len: int) -> tuple[Workload, list[list[int]]]:
    """Every shipped prompt once, all arriving at time 0, ``output_len`` tokens each; and their token ids."""
    prompts = encode_prompts(tokenizer, read_prompts())
    n = len(prompts)
    return Workload(np.zeros(n), [len(p) for p in prompts], np.full(n, output_len), "shipped prompts"), prompts


def measure_acceptance(pair: ModelPair, k: int, output_len: int, max_num_seqs: int, temperature: float,
                       seed: int) -> EngineResult:
    """Serve the shipped prompts with ``fixed-k`` speculation (the engine's draft) and return the run."""
    if pair.draft is None or pair.tokenizer is None:
        raise UserError(f"--acceptance: the {pair.name} pair has no draft model or no tokenizer")
    if k < 1:
        raise UserError(f"--k: must be >= 1 to measure acceptance (got {k})")
    workload, prompts = shipped_workload(pair.tokenizer, output_len)
    engine = RealEngine(pair.target, pair.draft, EngineConfig(max_num_seqs=max_num_seqs, max_k=k,
                                                                  temperature=temperature),
                           make_policy("fixed-k", k), None, np.random.default_rng(seed))
    return engine.run(workload, prompts)


def write_trace(result: EngineResult, path: str) -> None:
    """The run's verification steps as a replay trace CSV (steps that proposed nothing left out)."""
    steps = result.acceptance[result.acceptance["proposed"] > 0]
    write_atomic(path, steps[TRACE_COLUMNS].to_csv(index=False))


def fit_report(path: str) -> str:
    """:func:`simulator.inputs.acceptance.fit_acceptance` of the trace at ``path``, as a few lines."""
    trace = read_acceptance_trace(path)
    fit = fit_acceptance(trace)
    beta = fit["beta"]
    steps = pd.DataFrame({"p": trace.proposed, "a": trace.accepted})
    length = (steps["a"].sum() + len(steps)) / len(steps)
    lines = [f"{path}: {trace.num_requests} requests, {len(steps)} steps, proposed {int(steps['p'].sum())}, "
             f"accepted {int(steps['a'].sum())}",
             f"  rate (pooled, per token): {fit['rate']:.3f}; mean acceptance length {length:.2f} tokens/step",
             "  beta: " + (f"mean {beta['mean']:.3f}, concentration {beta['concentration']:.1f}" if beta else "n/a"),
             "  per position: " + ", ".join(f"{p:.3f}" for p in fit["positions"])]
    return "\n".join(lines)
