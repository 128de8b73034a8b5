"""The user-facing ``kv_cache_dtype`` values, without importing torch (the CLIs' parsers use them
before anything heavy is loaded). The low-bit weight format maps each to its torch dtype."""

KV_CACHE_DTYPES = ("auto", "float16", "float32", "int8")
