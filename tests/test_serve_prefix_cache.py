"""The prefix cache behind `batchspec serve`: on by default there, a two-turn chat and requests sharing a
system message reuse it with outputs still equal to plain decoding of each request alone, and the
Prometheus counters carry vLLM's names, counted in tokens."""

from __future__ import annotations

import json

import pytest
from test_serve import MODEL, chat_pair, client, extra, models, oracle, params, scrape, serving  # noqa: F401 (fixtures)

from batchspec.cli import build_parser
from batchspec.commands.common import config_from_args
from batchspec.config import SpecConfig
from batchspec.models import encode_prompt
from batchspec.serve import ServeOptions, create_app
from batchspec.serve.text import encode_chat

SYSTEM = " ".join(["the water is long and the day is long for all of them"] * 4)


def test_serve_turns_the_cache_on_by_default_and_the_api_does_not():
    args = build_parser(["serve"]).parse_args(["serve"])
    assert config_from_args(SpecConfig, args).prefix_cache_gb is None  # on where the method allows it
    assert SpecConfig().prefix_cache_gb == 0


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_shared_system_message_and_a_second_turn_hit_the_cache(models, chat_pair, oracle, chunk) -> None:  # noqa
    """Two requests share a system message, then the first conversation's second turn; all equal plain
    decoding, and the counters (vLLM's names, in tokens) match the engine's."""
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="fixed", prefix_cache_gb=None,
                      max_prefill_tokens=chunk)
    app = create_app(models, chat_pair, spec, ServeOptions(served_model_name=MODEL))
    with serving(app) as url:
        api = client(url)
        turns = []
        for question in ("call him now", "write the number"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                extra_body={"return_token_ids": True})
            turns.append((messages, reply))
        before = app.state.engine_loop.engine.stats.prefix_cache_hits
        first_messages, first = turns[0]
        follow = [*first_messages, {"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "what time is it"}]
        second = api.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0,
                                             extra_body={"return_token_ids": True})
        metrics = scrape(url)
    for messages, reply in [*turns, (follow, second)]:
        ids = encode_chat(models.tokenizer, messages)
        assert extra(reply.choices[0])["token_ids"] == oracle(tuple(ids), params(8))
    stats = app.state.engine_loop.engine.stats
    queries = metrics[("vllm:prefix_cache_queries_total", ())]
    hits = metrics[("vllm:prefix_cache_hits_total", ())]
    assert queries == stats.prefix_cache_queries == metrics[("vllm:prompt_tokens_total", ())]
    assert hits == stats.prefix_cache_hits
    system_blocks = len(encode_chat(models.tokenizer, first_messages)) // 16 * 16 - 16  # the system part at least
    assert hits >= 2 * system_blocks > 0
    assert stats.prefill_fed == stats.prefill_tokens - hits
    # the second turn resends the first turn and its answer: those come from the cache (the answer's
    # last token has no K/V, and a partial block is recomputed)
    first_turn = len(encode_chat(models.tokenizer, first_messages)) + len(extra(first.choices[0])["token_ids"]) - 1
    assert hits - before == first_turn // 16 * 16


def test_without_the_cache_the_counters_stay_at_zero(models, chat_pair) -> None:  # noqa: F811
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="fixed")
    app = create_app(models, chat_pair, spec, ServeOptions(served_model_name=MODEL))
    with serving(app) as url:
        prompt = encode_prompt(models.tokenizer, SYSTEM, chat_template=False)
        for _ in range(2):
            client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        metrics = scrape(url)
    assert metrics[("vllm:prefix_cache_queries_total", ())] == metrics[("vllm:prefix_cache_hits_total", ())] == 0


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_bench_serve_workloads_report_prompt_tokens_computed_and_ttft(models, chat_pair, tmp_path, workload, capsys):  # noqa
    """A smoke test on the tiny pair: the workloads run, and the report's prompt tokens computed fall
    below those sent (the cache found the shared system prompt, or the first turn in the second)."""
    from batchspec.cli import main

    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="fixed", prefix_cache_gb=None)
    app = create_app(models, chat_pair, spec, ServeOptions(served_model_name=MODEL))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{q} {SYSTEM[:60]}\n" for q in ("how many people", "write a word", "call him now")))
    out = tmp_path / "bench.json"
    with serving(app) as url:
        assert main(["bench-serve", "--base-url", url + "/v1", "--prompts", str(prompts), "--num-prompts", "3",
                     "--max-tokens", "6", "--concurrency", "1", "--workload", workload, "--system-words", "60",
                     "--follow-up", "what time is it", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Prompt tokens computed" in printed
    report = json.loads(out.read_text())
    cache = report["prefix_cache"]
    assert report["completed"] == (3 if workload == "shared-prefix" else 6)
    assert 0 < cache["prompt_tokens_computed"] < cache["prompt_tokens_sent"] == report["total_input_tokens"]
    assert cache["hit_rate"] > 0
    if workload == "multi-turn":
        assert len(report["ttft_ms_by_turn"]) == 2 and "TTFT, turn 2" in printed


def test_n_choices_cost_one_prefill(models, chat_pair, oracle) -> None:  # noqa: F811
    """`n = 4` on one prompt: the first choice prefills it, the other three find it in the cache (all
    but the last token of each), and every choice is plain seeded sampling with seed + i."""
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=4, speculation="fixed", prefix_cache_gb=None)
    app = create_app(models, chat_pair, spec, ServeOptions(served_model_name=MODEL))
    ids = encode_prompt(models.tokenizer, SYSTEM, chat_template=False)
    with serving(app) as url:
        reply = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.8, seed=3, n=4,
                                               extra_body={"return_token_ids": True})
        metrics = scrape(url)
    for choice in reply.choices:
        sp = params(6, temperature=0.8, seed=3 + choice.index)
        assert extra(choice)["token_ids"] == oracle(tuple(ids), sp)
    hit = min(len(ids) // 16 * 16, len(ids) - 1)  # per later choice: whole blocks, never the last token
    assert metrics[("vllm:prefix_cache_hits_total", ())] == 3 * hit
    assert app.state.engine_loop.engine.stats.prefill_fed == len(ids) + 3 * (len(ids) - hit)
