"""The official `openai` client against `batchspec serve`.

    batchspec serve --port 8000 --api-key "$KEY" &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --api-key "$KEY"
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, max_tokens=16, seed=1, temperature=0.7,
                                          messages=[{"role": "user", "content": "Name three primes."}])
    print("chat:", chat.choices[0].message.content, chat.usage)
    stream = client.completions.create(model=model, prompt="a b c", max_tokens=8, stream=True)
    print("stream:", "".join(chunk.choices[0].text for chunk in stream))


if __name__ == "__main__":
    main()
