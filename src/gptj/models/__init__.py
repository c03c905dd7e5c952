"""The architectures gptj runs, one file each, as plain math: gptj.py (GPT-J), llama.py (Llama). base.py
holds what they share (attention, the contiguous KV cache, padding masks); registry.py chooses one by
config.json's model_type."""
