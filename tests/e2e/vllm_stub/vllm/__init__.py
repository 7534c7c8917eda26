"""NOT vLLM: a test stand-in with the signatures ferry_vllm uses (see ../README.md)."""
