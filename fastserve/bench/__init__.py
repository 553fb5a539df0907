"""`fastserve bench`: load any LLM server (or an in-process Engine) and show where its time goes.

prompts.py (prompt sets) → client.py (one streaming request per API) → load.py (closed and open
loops, probes, RSS, the tracer's window) → figures.py (percentiles) → report.py (tables, JSON),
plots.py (PNGs); run.py wires them for the command line. inprocess.py is the older thread-based
in-process loop that some bench/ scripts still call.
"""
from .inprocess import LoadResult, closed_loop, format_rows
from .prompts import SENTENCES, make_prompts

__all__ = ["LoadResult", "closed_loop", "format_rows", "SENTENCES", "make_prompts"]
