"""deepinfer-recipe: HTTP protocol codecs (OpenAI Chat Completions / Responses, Anthropic
Messages) and the DeepSeek V4 prompt encoding and output parser. Entry point: ``plugin``."""
