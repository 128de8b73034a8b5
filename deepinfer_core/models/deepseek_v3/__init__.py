"""DeepSeek-V3: multi-head latent attention (``mla``), sigmoid-routed MoE, checkpoint names (``weights``)."""
