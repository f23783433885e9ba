"""One request served alone (profiles.validation.single_request) on the tiny random pair: the run's figures, its memory
(weights counted once, the KV cache at its largest) and the simulator's prediction of the same run."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from profiles.models.pairs import draft_config, new_draft  # noqa: E402
from profiles.validation.single_request import policy_k, predict, serve_one, weight_bytes  # noqa: E402
from policies.errors import UserError  # noqa: E402

pytestmark = pytest.mark.torch
PROMPT, OUTPUT_LEN = 12, 9


@pytest.fixture(scope="module")
def prompt(pair):
    return np.random.default_rng(0).integers(0, pair.target.config.vocab_size, PROMPT).tolist()


def kv_bytes_per_token(model) -> int:
    """2 (keys and values) x layers x kv heads x head dim x 4 bytes (float32)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def test_the_target_alone_decodes_one_token_a_step_and_holds_its_whole_context_at_the_end(pair, prompt):
    run = serve_one(pair, prompt, OUTPUT_LEN, "no-spec")
    row = run.row()
    assert (row["output_tokens"], row["decode_steps"], row["draft_passes"]) == (OUTPUT_LEN, OUTPUT_LEN - 1, 0)
    assert row["tokens_per_second"] == pytest.approx(OUTPUT_LEN / row["latency"])
    assert 0 < row["ttft"] < row["latency"]
    assert np.isnan(row["acceptance_rate"]) and np.isnan(row["acceptance_length"])
    # The last pass feeds token OUTPUT_LEN - 1: the cache then holds the prompt and all but the last output token.
    assert run.peak_kv_bytes == (PROMPT + OUTPUT_LEN - 1) * kv_bytes_per_token(pair.target)
    assert run.weight_bytes == weight_bytes([pair.target])


def test_speculation_is_lossless_and_its_memory_adds_the_draft_and_the_lookahead(pair, prompt):
    plain = serve_one(pair, prompt, OUTPUT_LEN, "no-spec")
    k = 2
    spec = serve_one(pair, prompt, OUTPUT_LEN, f"fixed-k:{k}")
    row = spec.row()
    assert spec.output == plain.output
    assert row["draft_passes"] == k * row["decode_steps"]
    assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["acceptance_length"] <= k + 1
    assert spec.weight_bytes == weight_bytes([pair.target, pair.draft]) > plain.weight_bytes
    # Both caches count; a verification pass holds up to k proposed tokens beyond the context before the rollback.
    per_token = kv_bytes_per_token(pair.target) + kv_bytes_per_token(pair.draft)
    assert plain.peak_kv_bytes < spec.peak_kv_bytes <= (PROMPT + OUTPUT_LEN - 1 + k) * per_token


def test_a_tensor_shared_by_target_and_draft_is_counted_once(pair):
    draft = new_draft(pair.target, draft_config(pair.target, num_layers=1, intermediate_size=64))
    own = sum(t.nbytes for name, t in itertools.chain(draft.named_parameters(), draft.named_buffers())
              if not name.startswith(("model.embed_tokens", "lm_head")))
    assert weight_bytes([pair.target, draft]) == weight_bytes([pair.target]) + own
    assert weight_bytes([pair.target, pair.target]) == weight_bytes([pair.target])


def test_policy_specs_name_their_bound_except_no_spec():
    assert policy_k("no-spec") == ("no-spec", 0, {})
    assert policy_k("goodput:3/bonus=1.1") == ("goodput", 3, {"bonus": 1.1})
    with pytest.raises(UserError, match=r"policy 'fixed-k': give the proposal length bound, NAME:K \(e.g. fixed-k:3\)"):
        policy_k("fixed-k")


def test_the_prediction_follows_the_cost_model_and_the_replayed_acceptance(cost_json, tmp_path):
    cost = cost_json(target=0.01, draft=0.002, prefill=0.05)
    always = tmp_path / "always.csv"
    always.write_text("request_id,proposed,accepted\n" + "0,5,5\n" * 4)
    plain = predict(PROMPT, OUTPUT_LEN, "no-spec", cost, always, seeds=2)
    assert plain["mean_ttft"] == pytest.approx(0.05)
    assert plain["mean_latency"] == pytest.approx(0.05 + (OUTPUT_LEN - 1) * 0.01)
    # A draft that is always right: each step emits k + 1 tokens for k draft passes and one verification.
    k = 3
    spec = predict(PROMPT, OUTPUT_LEN, f"fixed-k:{k}", cost, always, seeds=2)
    steps = (OUTPUT_LEN - 1) // (k + 1)
    assert spec["mean_latency"] == pytest.approx(0.05 + steps * (k * 0.002 + 0.01))
    assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] == k + 1
    with pytest.raises(UserError, match="predict: seeds must be >= 1"):
        predict(PROMPT, OUTPUT_LEN, "no-spec", cost, always, seeds=0)
