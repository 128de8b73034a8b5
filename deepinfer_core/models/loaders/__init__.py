"""Model files on disk -> :class:`~deepinfer_core.models.loaders.files.ModelFiles`, one loader per
file type: GGUF files (``gguf``, with its start-up cache ``gguf_cache`` and tensor index
``gguf_index``) and Hugging Face directories (``hf``, FP8 block checkpoints through
``fp8_checkpoint``). Each declares its :class:`~.files.FileFormat`; ``formats.open_model_files``
finds the one a path needs."""
