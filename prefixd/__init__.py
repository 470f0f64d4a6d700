"""prefixd: a local LLM inference daemon with exact prompt-prefix reuse."""

__version__ = "0.1.0"
