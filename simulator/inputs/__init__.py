"""Inputs: workloads (arrivals and lengths, traces), acceptance models, and the CSV checks they share.

The request traces the project uses ship in ``traces/`` beside this file, each folder with its licence and
attribution (``traces/README.md``); nothing outside the repository is read."""
from pathlib import Path

#: The shipped request traces (``traces/README.md``: sources, licences, what to cite).
TRACES = Path(__file__).resolve().parent / "traces"
#: Azure LLM inference 2023 (Patel et al., Splitwise, ISCA 2024; CC-BY 4.0): conversation and code services.
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
#: Mooncake's conversation trace (Qin et al., FAST 2025; Apache-2.0): with ``hash_ids`` (prefix caching), and plain.
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
MOONCAKE_PLAIN = TRACES / "mooncake" / "conversation.csv"
#: ShareGPT conversation lengths (Llama-2 tokenizer), from Sarathi-Serve's data (Apache-2.0).
SHAREGPT_STATS = TRACES / "sharegpt_8k_stats" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
