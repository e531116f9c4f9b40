"""The engine's step API, as a server drives it: add requests while others decode, abort one.

    python examples/step_api.py [--target T --draft D]
"""

from __future__ import annotations

import argparse

from batchspec import ModelConfig, SamplingParams, SpecConfig
from batchspec.build import build_engine
from batchspec.models import encode_prompt, eos_token_ids, load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    args = parser.parse_args()
    models = load_pair(ModelConfig(args.target, args.draft))
    stop_ids = eos_token_ids(models.target, models.tokenizer)
    engine = build_engine(models.target, SpecConfig(method="ragged", num_draft_tokens=4, max_prefill_tokens=16),
                          stop_ids, draft_model=models.draft)
    engine.reserve(rows=4, capacity=256)  # the K/V buffers, allocated once
    params = SamplingParams(max_new_tokens=16)
    first = engine.add_request(encode_prompt(models.tokenizer, "a b c d", chat_template=False), params)
    doomed = engine.add_request(encode_prompt(models.tokenizer, "e f g", chat_template=False), params)
    step = 0
    while engine.has_unfinished():
        for seq in engine.step():  # admit + prefill, then one draft/verify/accept/commit round
            print(f"step {step}: request {seq.index} finished ({seq.finish_reason}): {seq.generated}")
        if step == 1:
            engine.abort(doomed)  # frees its row at once, target and drafter
            engine.add_request(encode_prompt(models.tokenizer, "h i", chat_template=False), params)
        step += 1
    print(f"request {first} and the late one finished; request {doomed} was aborted")


if __name__ == "__main__":
    main()
