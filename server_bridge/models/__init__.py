"""Model providers: the interface and the two that ship (scripted, OpenAI-compatible)."""
