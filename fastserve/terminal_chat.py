"""`fastserve run [MODEL]`: a chat with one model in the terminal, as `ollama run` gives one.

    >>> a message            the reply streams as it is generated; the conversation so far is its context
    Ctrl-C                   stops a reply (what was shown stays in the conversation); at the prompt, a hint
    /bye, Ctrl-D             leave
    /clear                   forget the conversation (the system prompt stays)
    /?                       these commands

MODEL: a GGUF file, or a name `fastserve pull` knows (pulled first if it is not here yet), or nothing for the
default model. The engine runs in-process (one slot: one conversation); nothing listens on a port.
"""
from __future__ import annotations

import os
import sys

from .errors import ContextExceeded, FastserveError

HELP = """Available commands:
  /clear   forget the conversation
  /bye     exit (also Ctrl-D)
  /?       this help
Ctrl-C stops a reply."""


def model_path(name: str | None) -> str:
    """The GGUF file `run` loads: a path as given, a pullable model's (pulled if needed), or the default model's."""
    from .models import catalog
    if name is None:
        return catalog.model_path(catalog.DEFAULT)
    if os.path.exists(name):
        return name
    if name in catalog.PULLABLE:
        return catalog.model_path(name)
    if name.endswith(".gguf") or os.sep in name:
        raise FastserveError(f"no such file: {name}")
    raise FastserveError(f"{name!r} is neither a file nor a model fastserve can pull; it can pull:\n"
                         f"{catalog.listing()}")


class TerminalChat:
    """The conversation and its loop. read(prompt) -> a line (EOFError at the end of input); write(text): the
    terminal's output. sampling: Engine.submit's keywords (temperature, max_tokens, ...)."""

    def __init__(self, engine, tokenizer, *, system: str | None = None, read=input, write=None, **sampling):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)
        self.read = read
        self.write = write or _stdout

    def run(self) -> int:
        """Until /bye or the end of input; returns the exit status."""
        while True:
            try:
                line = self.read(">>> ")
            except EOFError:
                self.write("\n")
                return 0
            except KeyboardInterrupt:
                self.write("\nUse Ctrl-D or /bye to exit.\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text.split()[0]):
                    return 0
                continue
            try:
                self.reply(text)
            except KeyboardInterrupt:       # before the reply began (its stream stops itself)
                self.write("\n")

    def command(self, word: str) -> bool:
        """A slash command; True to leave."""
        if word in ("/bye", "/exit"):
            return True
        if word == "/clear":
            self.messages = list(self.start)
            self.write("Cleared the conversation.\n")
        elif word in ("/?", "/help"):
            self.write(HELP + "\n")
        else:
            self.write(f"Unknown command {word!r}. Type /? for help.\n")
        return False

    def reply(self, text: str) -> None:
        """The model's answer to the user's text, streamed; it joins the conversation (cut short by Ctrl-C:
        what was shown)."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        try:
            stream = self.engine.submit(prompt, **self.sampling)
        except ContextExceeded as exc:
            self.messages.pop()
            self.write(f"The conversation no longer fits the context ({exc.n_prompt} tokens, {exc.n_ctx} at most): "
                       f"/clear to start again, or run with a larger -c.\n")
            return
        shown = []
        try:                                # Ctrl-C: SIGINT's KeyboardInterrupt, here in the main thread
            for piece in stream:
                shown.append(piece)
                self.write(piece)
        except KeyboardInterrupt:
            stream.cancel()
        self.write("\n\n")
        self.messages.append({"role": "assistant", "content": "".join(shown)})


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(args) -> int:
    """`fastserve run` (cli.py parses its flags)."""
    from .config import EngineConfig
    from .engine import Engine
    from .models.model import load_model
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and the arrow keys' history for input())
    model = load_model(model_path(args.model_name))
    print(f"fastserve: {model.load_summary()}; /? for help, /bye to leave", file=sys.stderr)
    config = EngineConfig.from_flags(args, n_parallel=1)
    with Engine(model, config) as engine:
        chat = TerminalChat(engine, model.tokenizer, system=args.system, max_tokens=args.n_predict,
                            temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed)
        return chat.run()
