"""fastserve: single-process LLM inference for llama-family GGUF models."""
