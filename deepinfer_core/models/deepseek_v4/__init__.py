"""DeepSeek-V4: the hybrid sliding / compressed-sparse / heavily-compressed attention stack.

``config`` parses the checkpoint's config, ``kv`` lays out block KV and state KV, ``compress`` and
``prefill`` / ``decode`` build the compressed entries and the indexer's selection, ``layers`` holds
hyper-connections and the MoE, ``mtp`` the multi-token-prediction block, ``weights`` the checkpoint
names, ``model`` the causal LM the engine drives.
"""
