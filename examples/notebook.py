"""fastserve in a notebook (or as a script): generation in this process, no server.

    python examples/notebook.py                  # FASTSERVE_MODEL=any-llama.gguf to use another model

Each `# %%` line starts a cell: Jupyter (via jupytext), VS Code and PyCharm run them one at a time.
"""
# %%
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import fastserve

model = fastserve.load_model(os.environ.get("FASTSERVE_MODEL") or fastserve.default_model_path())
engine = fastserve.Engine(model, n_parallel=4, n_ctx=4096)     # 4 slots of 1024 tokens

# %% One completion. temperature=0 is greedy: the same text every time.
out = engine.generate("The capital of France is", max_tokens=16, temperature=0)
print(f"{out.text!r}  ({len(out.token_ids)} tokens, finish: {out.finish_reason})")

# %% Streaming: text pieces as the tokens are decoded (never half a UTF-8 character).
for piece in engine.stream("Once upon a time", max_tokens=32, temperature=0.8, seed=1):
    print(piece, end="", flush=True)
print()

# %% Chat: the model's own chat template turns messages into its prompt.
chat = model.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
print(engine.generate(chat, max_tokens=32, temperature=0).text)

# %% Batched: generate() from several threads at once; the engine decodes their requests together,
# and each one's text is what it would be alone (a token does not depend on its batch).
prompts = ["The sun is", "My favourite food is", "In 1969, astronauts", "The best way to learn is"]
alone = [engine.generate(p, max_tokens=24, temperature=0).text for p in prompts]
t0 = time.perf_counter()
with ThreadPoolExecutor(len(prompts)) as pool:
    together = list(pool.map(lambda p: engine.generate(p, max_tokens=24, temperature=0).text, prompts))
print(f"{len(prompts)} requests in {time.perf_counter() - t0:.2f} s; same text as one at a time: {together == alone}")


# %% async for: readers are async iterators too (any asyncio loop). Two replies interleave here.
async def tell(prompt: str) -> str:
    reader = engine.submit(prompt, max_tokens=24, temperature=0)
    pieces = []
    async for piece in reader:
        pieces.append(piece)
    return "".join(pieces)


async def main():
    return await asyncio.gather(tell("Roses are red,"), tell("Twinkle, twinkle,"))

# In Jupyter, whose loop is already running, write `await main()` instead.
for text in asyncio.run(main()):
    print(repr(text))

# %% The engine's decode thread stops here (or leave the engine to the end of the session).
engine.close()
