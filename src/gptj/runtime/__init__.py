"""The front door, from settings to a running engine, in modules of its own:

    spec.py    ModelSpec (what model, how: dtype, device, quantize, tp/pp) and KV sizing
    flags.py   each CLI flag declared once, onto a ModelSpec and an EngineConfig
    build.py   load_model(spec) (read, quantize, shard) and build_engine (plan, prepare, Engine)

The light helpers every layer shares live below the model: gptj.device (dtype names, devices) and
gptj.threads (compute threads).
"""
