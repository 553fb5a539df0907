"""A desktop chat window that runs the model inside this process (Tkinter, in Python's standard library).

    python examples/desktop_chat.py                      # the default model (pulled on first use)
    python examples/desktop_chat.py --model any-llama.gguf

The GUI thread never waits for the model. Each reply is one engine request; a worker thread iterates
its reader (blocking there is fine) and puts the text pieces on a queue; the GUI thread takes them from
a Tk timer (after()), so text reaches the window through the toolkit's own event loop, and the window
keeps redrawing, scrolling and answering clicks while tokens arrive. Stop, or closing the window,
cancels the request: the engine frees its slot within a step.
"""
from __future__ import annotations

import argparse
import os
import queue
import threading
import tkinter as tk
from tkinter import ttk

import fastserve

POLL_MS = 15            # how often the GUI thread picks up new text (about 60 times a second)


def decode_threads() -> int:
    """Threads for the model's step: every core but one, which stays free for the GUI."""
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else 1


class ChatWindow:
    """The widgets, and one conversation with the engine."""

    def __init__(self, root: tk.Tk, engine: fastserve.Engine, tokenizer, max_tokens: int = 256,
                 temperature: float = 0.7):
        self.root, self.engine, self.tokenizer = root, engine, tokenizer
        self.history: list[dict] = []        # the chat so far: {"role", "content"}
        self.reader = None                   # the running reply's reader, None between replies
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()   # worker -> GUI: str pieces, then the Completion
        self.reply: list[str] = []           # the running reply's pieces
        self.last_stats = ""                 # "N tokens · R tokens/s · first token T ms" of the last reply

        root.title("fastserve chat")
        root.geometry("760x520")
        root.protocol("WM_DELETE_WINDOW", self.close)       # closing the window cancels the reply first

        self.transcript = tk.Text(root, wrap="word", state="disabled", padx=8, pady=8)
        self.transcript.tag_configure("user", foreground="#1f4fb0", spacing1=6)
        self.transcript.tag_configure("stats", foreground="#777777")
        self.transcript.pack(fill="both", expand=True)

        settings = ttk.Frame(root, padding=(8, 4))
        settings.pack(fill="x")
        ttk.Label(settings, text="temperature").pack(side="left")
        self.temperature = ttk.Spinbox(settings, from_=0.0, to=2.0, increment=0.1, width=5)
        self.temperature.set(temperature)
        self.temperature.pack(side="left", padx=(2, 12))
        ttk.Label(settings, text="max tokens").pack(side="left")
        self.max_tokens = ttk.Spinbox(settings, from_=1, to=4096, increment=32, width=6)
        self.max_tokens.set(max_tokens)
        self.max_tokens.pack(side="left", padx=2)
        self.status = ttk.Label(settings, text="ready")
        self.status.pack(side="right")

        bar = ttk.Frame(root, padding=8)
        bar.pack(fill="x")
        self.entry = ttk.Entry(bar)
        self.entry.pack(side="left", fill="x", expand=True)
        self.entry.bind("<Return>", lambda event: self.send())
        self.send_button = ttk.Button(bar, text="Send", command=self.send)
        self.send_button.pack(side="left", padx=(8, 0))
        self.stop_button = ttk.Button(bar, text="Stop", command=self.stop, state="disabled")
        self.stop_button.pack(side="left", padx=(8, 0))
        self.entry.focus_set()

    # -- the GUI thread ------------------------------------------------------------------------

    def send(self) -> None:
        prompt = self.entry.get().strip()
        if not prompt or self.reader is not None:
            return
        messages = self.history + [{"role": "user", "content": prompt}]
        try:
            # submit() returns at once: the request is queued for the decode thread.
            self.reader = self.engine.submit(self.tokenizer.apply_chat_template(messages),
                                             max_tokens=int(self.max_tokens.get()),
                                             temperature=float(self.temperature.get()))
        except (ValueError, fastserve.FastserveError) as exc:     # bad settings, prompt too long, busy
            self.status.configure(text=f"not sent: {exc}")
            return
        self.entry.delete(0, "end")
        self.history = messages
        self._show(f"You: {prompt}\n", "user")
        self._show("Model: ")
        self.reply = []
        threading.Thread(target=self._read, args=(self.reader, self.pieces), daemon=True).start()
        self.send_button.state(["disabled"])
        self.stop_button.state(["!disabled"])
        self.status.configure(text="generating…")
        self.root.after(POLL_MS, self._poll)

    def _poll(self) -> None:
        """Show whatever text arrived since the last look; never waits."""
        done = None
        while True:
            try:
                item = self.pieces.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, str):
                self.reply.append(item)
                self._show(item)
            else:
                done = item
        if done is None:
            self.root.after(POLL_MS, self._poll)
        else:
            self._finish(done)

    def _finish(self, out) -> None:
        self.reader = None
        self.history.append({"role": "assistant", "content": "".join(self.reply)})
        n = len(out.token_ids)
        first_ms = out.timings.get("first_token_ms", 0.0)
        decode_s = (out.timings["total_ms"] - first_ms) / 1e3
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        note = {"cancelled": " · stopped", "length": " · max tokens"}.get(out.finish_reason, "")
        self.last_stats = f"{n} tokens · {rate:.1f} tokens/s · first token {first_ms:.0f} ms{note}"
        self._show(f"\n{self.last_stats}\n", "stats")
        self.send_button.state(["!disabled"])
        self.stop_button.state(["disabled"])
        self.status.configure(text="ready")

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.cancel()         # the slot is free within a step; the worker then sees the end

    def close(self) -> None:
        self.stop()
        self.root.destroy()

    def _show(self, text: str, tag: str = "") -> None:
        self.transcript.configure(state="normal")
        self.transcript.insert("end", text, tag)
        self.transcript.configure(state="disabled")
        self.transcript.see("end")

    # -- the worker thread: blocks on the reader, never touches a widget -------------------------

    @staticmethod
    def _read(reader, pieces: queue.SimpleQueue) -> None:
        for piece in reader:
            pieces.put(piece)
        pieces.put(reader.result())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a llama GGUF file (default: SmolLM2-135M-Instruct, pulled on first use)")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    model = fastserve.load_model(args.model or fastserve.default_model_path())
    with fastserve.Engine(model, n_parallel=1, n_ctx=4096, threads=decode_threads()) as engine:
        root = tk.Tk()
        ChatWindow(root, engine, model.tokenizer, max_tokens=args.max_tokens)
        root.mainloop()


if __name__ == "__main__":
    main()
