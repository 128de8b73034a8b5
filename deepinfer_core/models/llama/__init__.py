"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral-style GQA, Qwen2 with q/k/v biases)."""
