"""Offline batch decoding with the Python API, checked against plain decoding.

    python examples/offline.py                      # the bundled pair
    python examples/offline.py --target T --draft D # any local HF folders or .gguf files
"""

from __future__ import annotations

import argparse

from batchspec import LLM, ModelConfig, SamplingParams, SpecConfig
from batchspec.reference import reference_decode

PROMPTS = ["Write a haiku about caches.", "def fibonacci(n):", "The three laws of thermodynamics are"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    args = parser.parse_args()
    llm = LLM(ModelConfig(args.target, args.draft, chat_template=args.chat_template),
              spec=SpecConfig(method="ragged", num_draft_tokens=4, batch_size=3))
    params = SamplingParams(max_new_tokens=24)
    for out in llm.generate(PROMPTS, params):
        plain = reference_decode(llm.models.target, out.prompt_token_ids, params, llm.stop_ids)
        print(f"{out.text!r}: {out.accepted}/{out.drafted} drafts accepted, identical to plain decoding: "
              f"{out.token_ids == plain}")


if __name__ == "__main__":
    main()
