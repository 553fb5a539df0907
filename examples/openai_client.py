"""The official `openai` package against `fastserve serve`: a streamed chat reply.

    fastserve serve --port 8080                   # in another terminal (add --api-key KEY to require one)
    python examples/openai_client.py [--base-url http://127.0.0.1:8080/v1] [--api-key KEY]
"""
import argparse
import time

import openai

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
p.add_argument("--api-key", default="none", help="the server's --api-key (any text when it has none)")
p.add_argument("--prompt", default="Write a haiku about the sea.")
args = p.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
model = client.models.list().data[0].id             # the one model the server runs
print(f"model: {model}")

t0 = time.perf_counter()
first = None
usage = None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "You are a concise assistant."},
              {"role": "user", "content": args.prompt}],
    max_tokens=64, temperature=0, stream=True,
    stream_options={"include_usage": True},          # the last chunk then carries the token counts
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    if chunk.choices and chunk.choices[0].delta.content:
        first = first or time.perf_counter()
        print(chunk.choices[0].delta.content, end="", flush=True)
seconds = time.perf_counter() - t0
print(f"\n[{usage.completion_tokens} tokens in {seconds:.2f} s, first after {((first or t0) - t0) * 1e3:.0f} ms]")
