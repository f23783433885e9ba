"""The default demo (``python run_sim.py`` with no arguments): does speculation pay, and up to which load?

A sweep on the measured H200 profile of Llama-2-7B with a 68M draft (Hugging Face eager forward passes,
bf16, random weights; ``profiles/data/h200__llama-2-7b__llama-68m.csv``): Poisson arrivals with ShareGPT-like lengths (a lognormal with
the medians of the ShareGPT statistics in ``shared/traces``: 415 output tokens; prompts shortened to a
512-token median so the demo stays short), acceptance 0.8, from light load to past saturation, for
no-spec, fixed k = 1, 3, 5, vLLM's batch-size threshold and SmartSpec's goodput policy. It prints a
table of mean latency and writes the figures. The workload is synthetic, so every machine gets the same
numbers for the same seed.
"""
from __future__ import annotations

from pathlib import Path

from simulator.config import SimConfig

DEMO_PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "data" / "h200__llama-2-7b__llama-68m.csv")
DEMO_RATES = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
DEMO_POLICIES = ["no-spec", "fixed-k:1", "fixed-k:3", "fixed-k:5", "threshold:3/max_batch=16", "goodput:5"]


def demo_config() -> SimConfig:
    return SimConfig(profile=DEMO_PROFILE, arrival="poisson", rate=1.0, num_requests=250, length_dist="lognormal",
                     prompt_len=512, output_len=415, length_sigma=0.6, max_prompt_len=4096, max_output_len=2048,
                     acceptance="constant", acceptance_rate=0.8, max_num_seqs=256, seed=0)


def run_demo(out: str, workers: int, quiet: bool) -> int:
    from simulator.studies.sweep import print_table, sweep_and_plot

    base = demo_config()
    print(f"specsim demo: {len(DEMO_POLICIES)} policies x {len(DEMO_RATES)} rates on {Path(DEMO_PROFILE).name}, "
          f"{base.num_requests} requests per run, acceptance {base.acceptance_rate}")
    summary, figures = sweep_and_plot(base, DEMO_POLICIES, DEMO_RATES, [0], {}, out, workers, quiet=quiet)
    method = summary["profile_method"].iloc[0]
    print_table(summary)
    print(f"(profile method: {method}; mean latency in seconds, lower is better)")
    for f in figures:
        print(f"figure: {f}")
    return 0
