"""The architectures gptj runs, one file each, as plain math: gptj.py (GPT-J). base.py holds what
they share (attention, the contiguous KV cache, padding masks)."""
