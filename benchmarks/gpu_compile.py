"""Every Triton kernel gptj launches, compiled for an NVIDIA GPU on a machine without one.

GPU machines are lent rarely; code that cannot run must still compile, and compile well. This script
calls gptj's own launchers (paged_decode, paged_prefill, store_kv, copy_blocks, int8_linear,
int4_linear, quantize_rows, rotary_qk_) on meta tensors of GPT-J 6B's shapes (and the attention
kernels at Llama-3.1-8B's grouped-query heads) with Triton's launch
replaced by a recorder, so the kernels, constexprs, num_warps and stages are those the engine would
launch, decided by the engine's own code. Each recorded launch is then specialized as Triton's
launcher would on a GPU (its binder: dtypes, ints equal to 1, 16-divisible ints and pointers) and
compiled ahead of time for the target (`triton.compile` on an ASTSource with a GPUTarget) through
Triton's bundled ptxas, whose `-v` report gives the registers and spilled bytes a thread uses.

    python benchmarks/gpu_compile.py --arch sm_90a [--json] [--default-only] [--kernel NAME] [--list]

prints one line a variant, or with --json one JSON object a line:
    {"kernel", "variant", "default", "registers", "spill_bytes", "shared_bytes", "num_warps", "ok"}
(and "error" where it failed). On an --arch without FP8 units (sm_80) the e4m3 cases (fp8 weights, KV,
activations) are left out, as gptj refuses fp8 there (policy.FP8_MIN_CAPABILITY); --list records the launches and prints them as one JSON object
{"cases", "launches": [{"kernel", "variant", "default"}]}, compiling nothing (no compiler needed).
`default` marks the variants the engine launches by default on
Hopper: a bfloat16 model, KV blocks of 16 tokens (any KV dtype: the engine's "auto", int8 and fp8),
decode groups of 1 to 8 rows (beam search up to 8 beams), the quantized GEMVs' and GEMMs' plans for
bfloat16 activations (int8 at any rows, int4 past 16: policy.linear_path). Exit status 1 if any
variant failed to compile or a default variant spilled.

Triton's interpreter (TRITON_INTERPRET=1) is unset for this run: it compiles, it does not interpret.
The figures are those of this machine's Triton and its ptxas (printed first); a GPU machine may run
another Triton (docs/GPU.md), whose compiler may allocate registers differently.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # (imported by a test, it leaves the interpreter as its process has it)
    os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (before Triton is imported)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

ARCHES = {"sm_80": 80, "sm_89": 89, "sm_90a": 90}  # --arch -> the compute capability Triton targets
HOPPER = "sm_90a"

# GPT-J 6B's shapes (what a compile depends on: dtypes, head size, block sizes, divisibility)
HEADS, HEAD_DIM, ROTARY_DIM = 16, 256, 64
CONTEXT = 2048  # n_positions: a decode launch of groups this long runs its most splits (and the merge)
N_EMBD, N_INNER, VOCAB = 4096, 16384, 50400
FUSED = 3 * N_EMBD + N_INNER  # the fused block's q|k|v|fc_in outputs
# Llama-3.1-8B's attention (grouped-query: 4 query heads a KV head, a program per KV head reads its blocks once)
GQA_HEADS, GQA_KV_HEADS, GQA_HEAD_DIM = 32, 8, 128
LINEARS = {"qkv|fc_in": (FUSED, N_EMBD, True), "out_proj": (N_EMBD, N_EMBD, False),
           "fc_out": (N_EMBD, N_INNER, True), "lm_head": (VOCAB, N_EMBD, True)}  # (N, K, bias)

COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KV = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}  # None: the compute dtype
DEFAULT_COMPUTE = "bf16"
DEFAULT_BLOCK = 16  # EngineConfig.block_size's default
DEFAULT_MAX_TILE = 8  # decode groups of up to 8 rows (beam search's usual widths) are defaults
TILES = (1, 2, 4, 8, 16)  # a decode step's largest group, rounded up to a power of two
BLOCKS = (16, 32, 64)  # KV block sizes the Triton kernels read (8 runs the reference's forms for prefill)


@dataclass(frozen=True)
class Case:
    """One way the engine calls a launcher: `launch` does it on meta tensors (a launcher may launch
    more than one kernel); `variant` says how; `default` as the module says."""

    variant: str
    default: bool
    launch: Callable[[], None]
    fp8: bool = False  # e4m3 weights, KV or activations: launched only on GPUs with FP8 units (policy)


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the JITFunction, its arguments, and which cases made it."""

    fn: object
    args: tuple
    kwargs: dict


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def ints(n: int) -> torch.Tensor:
    return meta(n, dtype=torch.int32)


# --- the cases: gptj's launchers as the engine calls them -------------------------------------


def attention_cases() -> Iterator[Case]:
    from gptj.engine.attention import cuda as ac

    for cname, cdtype in COMPUTE.items():
        for kname, kdtype in KV.items():
            kv_dtype = kdtype or cdtype
            quantized = kdtype is not None
            fp8 = kv_dtype == torch.float8_e4m3fn
            for B in BLOCKS:
                kc = meta(64, HEADS, B, HEAD_DIM, dtype=kv_dtype)
                scales = (meta(64, HEADS, B, dtype=torch.float32),) * 2 if quantized else ()
                base_default = cname == DEFAULT_COMPUTE and B == DEFAULT_BLOCK
                tag = f"{cname} kv={kname} B={B}"
                for R in TILES:
                    # the default variant's launches at each step's largest group (those it never makes at R:
                    # not defaults)
                    chosen = {(k, t) for k, t, _, _ in ac.decode_launches(ac.CudaAttention.decode_variant, R, B)}
                    for variant in ("sum", "dot"):
                        if ac.decode_launches(variant, R, B)[0][0] != variant:
                            continue  # blocks under tl.dot's tile: "dot" runs "sum"
                        groups = 4
                        q = meta(groups * R, HEADS, HEAD_DIM, dtype=cdtype)
                        tables = (ints(groups + 1), ints(40), ints(groups), ints(groups), ints(groups * R * 3).view(
                            groups * R, 3), ints(groups * R))
                        yield Case(f"decode {variant} tile={R} {tag}",
                                   base_default and (variant, R) in chosen and R <= DEFAULT_MAX_TILE,
                                   _call(ac.paged_decode, q, kc, kc, tables, R, *scales, out_dtype=cdtype,
                                         variant=variant, max_shared=CONTEXT), fp8)  # split: the merge too
                if B >= ac.PREFILL_TILE:
                    q = meta(100, HEADS, HEAD_DIM, dtype=cdtype)
                    yield Case(f"prefill {tag}", base_default, _call(ac.paged_prefill, q, kc, kc, ints(40).long(), 37,
                                                                    *scales), fp8)
                fused = meta(8, FUSED, dtype=cdtype)  # k, v: views of the fused block's output rows
                k = fused[:, N_EMBD:2 * N_EMBD].view(8, HEADS, HEAD_DIM)
                v = fused[:, 2 * N_EMBD:3 * N_EMBD].view(8, HEADS, HEAD_DIM)
                yield Case(f"store {tag}", base_default, _call(ac.store_kv, k, v, kc, kc, ints(8).long(),
                                                               ints(8).long(), *scales), fp8)
                stacked = [meta(28, 64, HEADS, B, HEAD_DIM, dtype=kv_dtype)] * 2
                if quantized:
                    stacked += [meta(28, 64, HEADS, B, dtype=torch.float32)] * 2
                yield Case(f"copy {tag}", base_default, _call(ac.copy_blocks, stacked, [(1, 2, 5), (3, 4, 7), (5, 6, 1)]),
                           fp8)


def gqa_cases() -> Iterator[Case]:
    """The decode and prefill kernels at Llama-3.1-8B's grouped heads (GQA_*): a bfloat16 model over
    blocks of 16 tokens, any KV dtype, decode groups of 1 to 16 rows. Defaults: single sequences and
    prefill (MLPerf's llama3.1-8b decodes greedily); beam groups' tiles are compiled by a full run,
    not by tests/test_gpu_compile.py (each default adds a compile to it)."""
    from gptj.engine.attention import cuda as ac

    cdtype, B = COMPUTE[DEFAULT_COMPUTE], DEFAULT_BLOCK
    for kname, kdtype in KV.items():
        kv_dtype = kdtype or cdtype
        quantized = kdtype is not None
        fp8 = kv_dtype == torch.float8_e4m3fn
        kc = meta(64, GQA_KV_HEADS, B, GQA_HEAD_DIM, dtype=kv_dtype)
        scales = (meta(64, GQA_KV_HEADS, B, dtype=torch.float32),) * 2 if quantized else ()
        tag = f"gqa {GQA_HEADS}/{GQA_KV_HEADS}x{GQA_HEAD_DIM} {DEFAULT_COMPUTE} kv={kname} B={B}"
        for R in TILES:
            chosen = {(k, t) for k, t, _, _ in ac.decode_launches(ac.CudaAttention.decode_variant, R, B)}
            for variant in ("sum", "dot"):
                q = meta(4 * R, GQA_HEADS, GQA_HEAD_DIM, dtype=cdtype)
                tables = (ints(5), ints(40), ints(4), ints(4), ints(4 * R * 3).view(4 * R, 3), ints(4 * R))
                yield Case(f"decode {variant} tile={R} {tag}", (variant, R) in chosen and R == 1,
                           _call(ac.paged_decode, q, kc, kc, tables, R, *scales, out_dtype=cdtype, variant=variant,
                                 max_shared=CONTEXT), fp8)
        q = meta(100, GQA_HEADS, GQA_HEAD_DIM, dtype=cdtype)
        yield Case(f"prefill {tag}", True, _call(ac.paged_prefill, q, kc, kc, ints(40).long(), 37, *scales), fp8)


def quant_cases(arch: str = HOPPER) -> Iterator[Case]:
    from gptj.policy import TRITON_GEMM_DTYPES
    from gptj.quant import cuda as qc

    capability = divmod(ARCHES[arch], 10)  # (the GEMM plans differ before Hopper: qc.plan_for)

    for cname, cdtype in COMPUTE.items():
        for rows in (1, 2, 16):
            for lname, (N, K, bias) in LINEARS.items():
                x = meta(rows, K, dtype=cdtype)
                b = meta(N, dtype=cdtype) if bias else None
                for wname, wdtype in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
                    yield Case(f"{wname} linear {lname} rows={rows} {cname}", cname == DEFAULT_COMPUTE,
                               _call(qc.int8_linear, x, meta(N, K, dtype=wdtype), meta(N), b), wname == "e4m3")
                for group in (128,):  # int4: Triton for float16 / float32 activations (bfloat16: tinygemm)
                    yield Case(f"int4 linear {lname} rows={rows} g={group} {cname}", False,
                               _call(qc.int4_linear, x, meta(N, K // 2, dtype=torch.uint8), meta(N, K // group),
                                     meta(N, K // group), group, b))
        # past 16 rows, the GEMM plans (qc.MANY_ROWS): int8 and int4 for 16-bit activations (policy.triton_takes;
        # bfloat16 int4 past tinygemm's 16 rows), e4m3 only where called directly (fp8 there runs torch._scaled_mm)
        for rows in (64, 2048) if cdtype in TRITON_GEMM_DTYPES else ():
            for lname, (N, K, bias) in LINEARS.items():
                x = meta(rows, K, dtype=cdtype)
                b = meta(N, dtype=cdtype) if bias else None
                for wname, wdtype in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
                    yield Case(f"{wname} linear {lname} rows={rows} gemm {cname}",
                               cname == DEFAULT_COMPUTE and wname == "int8",
                               _call(qc.int8_linear, x, meta(N, K, dtype=wdtype), meta(N), b,
                                     tiles=qc.plan_for(wname, rows, capability)), wname == "e4m3")
                yield Case(f"int4 linear {lname} rows={rows} g=128 gemm {cname}", cname == DEFAULT_COMPUTE,
                           _call(qc.int4_linear, x, meta(N, K // 2, dtype=torch.uint8), meta(N, K // 128),
                                 meta(N, K // 128), 128, b, tiles=qc.plan_for("int4", rows, capability)))
        # the kinds no plan_for plan runs (benchmarks/gemv_sweep.py times them): int8 "swapped", int4 "mma"
        N, K, _ = LINEARS["out_proj"]
        x = meta(16, K, dtype=cdtype)
        yield Case(f"int8 linear out_proj rows=16 swapped (gemv_sweep) {cname}", False,
                   _call(qc.int8_linear, x, meta(N, K, dtype=torch.int8), meta(N),
                         tiles=qc.Tiles(kind="swapped", rows=16, block_n=64, int8_block_k=128)))
        yield Case(f"int4 linear out_proj rows=16 mma (gemv_sweep) {cname}", False,
                   _call(qc.int4_linear, x, meta(N, K // 2, dtype=torch.uint8), meta(N, K // 128),
                         meta(N, K // 128), 128, tiles=qc.TILES))
        for K in (N_EMBD, N_INNER):
            for kind in qc.ROW_KINDS:
                for mul in (None, meta(K, dtype=torch.float32)):
                    yield Case(f"quantize rows {kind} K={K} {'mul ' if mul is not None else ''}{cname}",
                               cname == DEFAULT_COMPUTE, _call(qc.quantize_rows, meta(32, K, dtype=cdtype), kind, mul),
                               kind == "e4m3")


def rotary_cases() -> Iterator[Case]:
    from gptj.kernels import triton_elementwise as te

    for cname in ("bf16", "fp16"):  # policy.elementwise_path: below float32 only
        y = meta(8, FUSED, dtype=COMPUTE[cname])
        yield Case(f"rotary {cname}", cname == DEFAULT_COMPUTE,
                   _call(te.rotary_qk_, y, HEADS, HEAD_DIM, meta(8, ROTARY_DIM), meta(8, ROTARY_DIM)))


def all_cases(arch: str = HOPPER) -> list[Case]:
    """Every case the engine can launch on `arch` (e4m3 ones only where policy allows FP8)."""
    from gptj.policy import FP8_MIN_CAPABILITY

    fp8_ok = ARCHES[arch] >= 10 * FP8_MIN_CAPABILITY[0] + FP8_MIN_CAPABILITY[1]
    return [c for c in (*attention_cases(), *gqa_cases(), *quant_cases(arch), *rotary_cases()) if fp8_ok or not c.fp8]


def _call(fn: Callable, *args, **kwargs) -> Callable[[], None]:
    return lambda: fn(*args, **kwargs)


# --- recording launches and compiling them ------------------------------------------------------


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within: a Triton launch (`kernel[grid](...)`) is recorded, not run."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ARG001 - JITFunction.run's signature
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


@contextmanager
def interpreted_keys() -> Iterator[list[str]]:
    """Under Triton's interpreter (TRITON_INTERPRET=1): within, each kernel launch runs as usual and
    its compile_key (what a GPU would compile for it) is recorded, in order."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    keys: list[str] = []
    run = InterpretedFunction.run
    jitted: dict[object, JITFunction] = {}

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001 - InterpretedFunction.run's signature
        fn = jitted.setdefault(self.fn, JITFunction(self.fn, **self.kwargs))
        keys.append(compile_key(Launch(fn, args, kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = record
    try:
        yield keys
    finally:
        InterpretedFunction.run = run


def specialize(launch: Launch, capability: int):
    """What Triton's launcher compiles this launch as on a GPU of `capability`: (the backend, its
    options, signature, constexprs, attrs), by Triton's own binder."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(GPUTarget("cuda", capability, 32))
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return (backend, *fn._pack_args(backend, kwargs, bound, specialization, options))


def compile_key(launch: Launch, capability: int = 90) -> str:
    """A launch's compiled-kernel identity: the kernel and what Triton specializes it on."""
    _, options, signature, constexprs, attrs = specialize(launch, capability)
    opts = {k: options.__dict__[k] for k in ("num_warps", "num_stages", "num_ctas")}
    return json.dumps([launch.fn.__name__, signature, sorted((str(k), str(v)) for k, v in constexprs.items()),
                       sorted((str(k), str(v)) for k, v in attrs.items()), opts])


PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_one(launch: Launch, arch: str) -> dict:
    """Compile `launch` for `arch`; ptxas -v's registers and spills (stores + loads, bytes a thread)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    capability = ARCHES[arch]
    row = {"kernel": launch.fn.__name__, "ok": False}
    try:
        _, options, signature, constexprs, attrs = specialize(launch, capability)
        row["num_warps"] = options.num_warps
        printed = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(printed):
            knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas's -v report (a cached kernel: none)
            compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", capability, 32), options=options.__dict__)
        row["shared_bytes"] = compiled.metadata.shared
        report = printed.getvalue()
        if not PTXAS_USED.search(report):  # from Triton's cache: assemble its PTX again for the report
            with tempfile.TemporaryDirectory() as tmp:
                ptx = Path(tmp, "k.ptx")
                ptx.write_text(compiled.asm["ptx"])
                report = subprocess.run([get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",
                                         f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp, "k.o"))],
                                        capture_output=True, text=True, check=True).stderr
        used, spill = PTXAS_USED.search(report), PTXAS_SPILL.search(report)
        row.update(registers=int(used[1]), spill_bytes=int(spill[1]) + int(spill[2]), ok=True)
    except Exception as e:  # noqa: BLE001 - reported as the variant's failure
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return row


def toolchain() -> dict:
    """The compiler this report comes from (Triton's version, its ptxas's)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    out = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout
    return {"triton": triton.__version__, "ptxas": (re.findall(r"release [\d.]+, V[\d.]+", out) or ["?"])[0]}


def can_compile() -> str | None:
    """None where Triton can compile for CUDA here, else why not (the test's reason to skip)."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
        subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, check=True)
    except Exception as e:  # noqa: BLE001 - any reason is the answer
        return f"Triton cannot compile for CUDA here ({type(e).__name__}: {e})"
    return None


def launches_of(cases: list[Case]) -> list[tuple[Launch, list[Case]]]:
    """Each distinct compiled kernel the cases launch, with the cases that launch it."""
    seen: dict[str, tuple[Launch, list[Case]]] = {}
    for case in cases:
        with recording() as launches:
            case.launch()
        for launch in launches:
            seen.setdefault(compile_key(launch), (launch, []))[1].append(case)
    return list(seen.values())


_WORK: list[tuple[Launch, list[Case]]] = []  # the pool's work list (inherited by forked workers)


def _compile_at(index_arch: tuple[int, str]) -> dict:
    index, arch = index_arch
    return compile_one(_WORK[index][0], arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHES), default=HOPPER)
    parser.add_argument("--json", action="store_true", help="one JSON object a variant, a line")
    parser.add_argument("--default-only", action="store_true", help="only the variants the engine launches by default")
    parser.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once (processes)")
    parser.add_argument("--list", action="store_true", help="record the launches and list them; compile nothing")
    args = parser.parse_args(argv)
    if args.list:  # no compiler needed: the launchers run on meta tensors, Triton's launch recorded
        cases = [c for c in all_cases(args.arch) if c.default or not args.default_only]
        print(json.dumps({"cases": len(cases), "launches": [
            {"kernel": launch.fn.__name__, "variant": " | ".join(c.variant for c in cs),
             "default": any(c.default for c in cs)} for launch, cs in launches_of(cases)]}))
        return 0
    why = can_compile()
    if why:
        print(f"gpu_compile: {why}", file=sys.stderr)
        return 2
    cases = [c for c in all_cases(args.arch) if c.default or not args.default_only]
    work = [(launch, cs) for launch, cs in launches_of(cases)
            if not args.kernel or launch.fn.__name__ in args.kernel]
    _WORK[:] = work
    print(f"# {len(work)} kernels from {len(cases)} launch cases, for {args.arch}: "
          + ", ".join(f"{k} {v}" for k, v in toolchain().items()), file=sys.stderr)
    jobs = [(i, args.arch) for i in range(len(work))]
    if args.jobs > 1 and len(work) > 1:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            rows = list(pool.map(_compile_at, jobs))
    else:
        rows = [_compile_at(j) for j in jobs]
    bad = 0
    for (launch, cs), row in zip(work, rows):
        default = any(c.default for c in cs)
        row = {"kernel": row["kernel"], "variant": " | ".join(c.variant for c in cs), "default": default,
               **{k: v for k, v in row.items() if k != "kernel"}}
        failed = not row["ok"] or (default and row["spill_bytes"] > 0)
        bad += failed
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            figures = (f"{row['registers']:3d} regs {row['spill_bytes']:5d} B spilled {row['shared_bytes']:6d} B shared"
                       if row["ok"] else row["error"])
            print(f"{'*' if default else ' '} {'FAIL' if failed else 'ok  '} {row['kernel']:28s} "
                  f"w{row.get('num_warps', '?')} {figures}  [{cs[0].variant}{' +%d' % (len(cs) - 1) if len(cs) > 1 else ''}]")
    print(f"# {len(rows) - bad} of {len(rows)} compiled within budget (default variants: 0 B spilled)"
          + (f"; {bad} not" if bad else ""), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
