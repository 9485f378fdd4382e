"""specinfer: tree-based speculative inference and verification for LLM serving."""

__version__ = "0.1.0"
