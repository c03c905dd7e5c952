"""How gptj runs a model: the helpers every command shares (dtypes, devices, threads), and the
front door from settings to a running engine, in modules of its own:

    spec.py    ModelSpec (what model, how: dtype, device, quantize, tp/pp, kernels) and KV sizing
    flags.py   each CLI flag declared once, onto a ModelSpec and an EngineConfig
    build.py   load_model(spec) (read, quantize, shard) and build_engine (plan, prepare, Engine)

Only the light helpers are imported here (and torch only inside them), so that `gptj --help`
starts fast and the layers below (weights) can use them.
"""

from gptj.runtime.device import DTYPE_NAMES, all_finite, dtype_name, parse_dtype, resolve_device
from gptj.runtime.threads import RESERVED_CORES, compute_threads, set_threads, usable_cores

__all__ = ["DTYPE_NAMES", "RESERVED_CORES", "all_finite", "compute_threads", "dtype_name", "parse_dtype",
           "resolve_device", "set_threads", "usable_cores"]
