"""The `gptj` command: subcommands map flags onto the typed configs.

User errors (GptjError) print one line and exit 1; --debug shows tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING
from pathlib import Path

from gptj.errors import GptjError, UsageError
from gptj.runtime import flags
from gptj.runtime.flags import nonnegative as _nonnegative
from gptj.runtime.flags import nonnegative_float as _nonnegative_float
from gptj.runtime.flags import positive as _positive
from gptj.runtime.flags import positive_float as _positive_float
from gptj.runtime.flags import probability as _probability
from gptj.runtime.flags import unit_interval as _unit_interval

if TYPE_CHECKING:
    from gptj.serve import ServerConfig

EXIT_USER_ERROR = 1
EXIT_USAGE = 2  # a flag that can never work (argparse's code too)
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command that SIGPIPE ended
EXIT_CHECKER_ERRORS = 3  # gptj submission: the tree is written; MLCommons' checker found errors in it
EXIT_DIFFER = 3  # gptj compare: it ran; the two models differ beyond the tolerance
EXIT_NOT_A_RESULT = 3  # gptj evaluate: scored, but the log did not answer every sample of its run


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not hit the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, "(default: X)", unless its help already says it or it has none
    worth showing (None; a switch that takes no value: its stored constant is no default a reader can
    use — `--no-x (default: True)` reads as if the flag were on — so its help says it in words)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS) \
            and action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if self._shows_default(action) and "default" not in text and text != argparse.SUPPRESS:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump), exit code 2, and shows defaults."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ids(text: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _tokenizer_for(model_dir: str | None):  # noqa: ANN202 - the one a model folder carries, else GPT-J's
    from gptj.tokenizer import tokenizer_for_model

    return tokenizer_for_model(model_dir)


def _tokenizer(path: str | None):  # noqa: ANN202 - an explicit --tokenizer must exist
    from gptj.tokenizer import load_tokenizer

    return load_tokenizer(path)


# --- subcommands -------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from gptj.config import get_preset
    from gptj.device import parse_dtype
    from gptj.weights.io import auto_progress, random_state_dict, save_checkpoint

    _check_out(args)
    config = get_preset(args.preset)
    progress = auto_progress(config)  # gptj-6b takes minutes: bars on stderr when it is a terminal
    sd = random_state_dict(config, seed=args.seed, dtype=parse_dtype(args.dtype), progress=progress)
    out = save_checkpoint(sd, config, args.out, overwrite=args.force, progress=progress)
    print(f"wrote {args.preset} with random weights (seed {args.seed}, {args.dtype}) to {out}")
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """An --out in the way is refused before any weight is read or made (the writer checks it again)."""
    out = Path(args.out)
    if not args.force and out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise GptjError(f"{out}: already exists (choose a new --out, or pass --force to replace it)")


def cmd_convert(args: argparse.Namespace) -> int:
    from gptj.device import parse_dtype
    from gptj.weights.io import convert

    _check_out(args)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    shards = None
    if args.tp is not None and args.tp > 1:  # each rank's shard beside the checkpoint (gptj.parallel.tp)
        from gptj.parallel.tp import check_plan, write_shards

        if args.quantize:
            raise GptjError("--tp with --quantize is not supported: tensor-parallel shards are float")

        say = _progress_line("convert")

        def shards(folder, sd, cfg):  # noqa: ANN001, ANN202 - convert's `also`
            check_plan(cfg, args.tp)
            if not args.quiet:  # (no bar of its own: a 6B model's shards take a while)
                say(f"writing the tensor-parallel shards of {args.tp} ranks")
            write_shards(sd, cfg, folder, args.tp)
    out = convert(args.src, args.out, fmt=args.fmt, dtype=dtype, config=args.config,
                  overwrite=args.force, progress=not args.quiet, quantize=args.quantize, group_size=args.group_size,
                  also=shards)
    print(f"wrote {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from gptj.mlperf.dataset import Dataset
    from gptj.device import resolve_device
    from gptj.runtime.spec import ModelSpec
    from gptj.weights.io import calibrate

    dataset = Dataset.load(args.dataset, tokenizer=_tokenizer_for(args.model), max_examples=args.samples)
    prompts = dataset.input_ids
    name = Path(dataset.path).name
    dtype = ModelSpec(path=args.model, dtype=args.dtype, device=args.device).torch_dtype  # auto / fast as everywhere
    record = calibrate(args.model, prompts, name, alpha=args.alpha, dtype=dtype, device=resolve_device(args.device))
    print(f"calibrated {args.model} for w8a8 on {record['samples']} prompts ({record['tokens']:,} tokens) of {name}, "
          f"alpha {record['alpha']:g}: wrote calibration.safetensors and config.json's 'calibration' "
          f"(use --quantize w8a8)")
    return 0


def generate_setup(args: argparse.Namespace):  # noqa: ANN201 - (tokenizer, prompts, gen, spec, engine config)
    """What `gptj generate` runs: its tokenizer, prompts (token ids), GenerationConfig, ModelSpec and
    EngineConfig (its prompts all at once, as the KV memory allows; the rest wait). Sequences may be
    as long as the model's context (the KV blocks a beam search takes beyond its sequences' own
    length, for its shared prompt, fit then; plan_kv bounds them by the free memory)."""
    from gptj.decode import GenerationConfig

    if not args.prompt and not args.prompt_ids:
        raise GptjError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    gen = GenerationConfig(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, num_beams=args.num_beams,
        do_sample=args.temperature > 0, temperature=args.temperature,
        top_k=args.top_k or None, top_p=args.top_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
    )
    tok = _tokenizer_for(args.model)
    prompts = [tok.encode(p) for p in args.prompt] + [list(ids) for ids in args.prompt_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise GptjError(f"prompt {i + 1} is empty")
    engine = flags.engine_config(args, max_seqs=len(prompts) * gen.num_beams)
    return tok, prompts, gen, flags.model_spec(args), engine


def cmd_generate(args: argparse.Namespace) -> int:
    from gptj.parallel.launch import NOT_RANK0, run_parallel, under_torchrun

    tok, prompts, gen, spec, engine = generate_setup(args)
    _check_parallel(spec.tp, spec.pp, spec.path)
    if spec.lora is not None:
        _warn_lora_base("generate", spec.lora, spec.path)
    if args.stream:
        if args.json or gen.num_beams > 1 or spec.world > 1 or under_torchrun():
            raise GptjError("--stream prints one greedy or sampled sequence's text as it comes: not with --json, "
                            "--num-beams > 1, --tp or --pp")
        _stream(tok, prompts, gen, spec, engine)
        return 0
    payload = {"spec": spec, "engine": engine, "gen": gen, "prompts": prompts, "debug": args.debug}
    if spec.world > 1 or under_torchrun():
        outputs = run_parallel(_generate_job, spec.world, payload, device=spec.device)
        if outputs is NOT_RANK0:
            return 0
    else:
        outputs = _generate_job(0, 1, payload)
    for i, (prompt, new) in enumerate(zip(prompts, outputs), 1):
        text = tok.decode(new)
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "token_ids": new, "text": text}, ensure_ascii=False))
        else:
            print(_label(i, len(prompts)) + text)
    return 0


def _warn_lora_base(command: str, adapter: str, base: str) -> None:
    """One line on stderr when an adapter names another base model than the one it is applied to."""
    from gptj.lora import base_mismatch

    why = base_mismatch(adapter, base)
    if why:
        print(f"gptj {command}: warning: {why}", file=sys.stderr)


def _label(i: int, n: int) -> str:
    """gptj generate's text output: with several prompts, each one's text starts with its number."""
    return f"[{i}] " if n > 1 else ""


def _stream(tok, prompts: list[list[int]], gen, spec, engine_config) -> None:  # noqa: ANN001
    """gptj generate --stream: each prompt in turn, its text printed as its tokens come (the engine's
    on_token); a token that ends inside a character waits for the next. The text is the one
    generate prints without --stream."""
    from gptj.engine.request import FAILED
    from gptj.runtime.build import build_engine, load_model

    engine = build_engine(load_model(spec), engine_config)
    for i, prompt in enumerate(prompts, 1):
        shown, tokens = "", []
        sys.stdout.write(_label(i, len(prompts)))
        sys.stdout.flush()

        def on_token(req, token: int) -> None:  # noqa: ANN001 - gptj.engine.request.Request
            nonlocal shown
            tokens.append(token)
            text = tok.decode(tokens)
            if text.startswith(shown) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

        req = engine.add_request(prompt, gen, on_token=on_token)
        while not req.done:
            engine.step()
        if req.status == FAILED:
            raise GptjError(f"generation failed: {req.error}")
        text = tok.decode(req.output)
        print(text[len(shown):] if text.startswith(shown) else "", flush=True)


def _server_config(args: argparse.Namespace, models: tuple[tuple[str, str], ...] = (),
                   adapters: tuple[tuple[str, str], ...] = ()) -> ServerConfig:
    from gptj.serve import ServerConfig

    return ServerConfig(models=models, lora=adapters, host=args.host, port=args.port, model=flags.model_spec(args),
                        engine=flags.engine_config(args), batch_wait_ms=args.batch_wait_ms, max_queue=args.max_queue,
                        request_timeout_s=args.request_timeout_s, drain_timeout_s=args.drain_timeout_s,
                        read_timeout_s=getattr(args, "read_timeout_s", 30.0),
                        max_connections=getattr(args, "max_connections", 512), api_key=args.api_key,
                        public_metrics=getattr(args, "public_metrics", False),
                        public_docs=getattr(args, "public_docs", False), admin_token=getattr(args, "admin_token", None),
                        model_root=getattr(args, "model_root", None), threads=getattr(args, "threads", None),
                        access_log=getattr(args, "access_log", True))


def cmd_serve(args: argparse.Namespace) -> int:
    from gptj.parallel.launch import run_parallel, under_torchrun
    from gptj.serve.registry import parse_model_arg
    from gptj.serve.server import serve

    if not args.ray:
        for flag in ("replicas", "address", "cpus_per_replica", "gpus_per_replica"):
            if getattr(args, flag) is not None:
                raise GptjError(f"--{flag.replace('_', '-')} needs --ray")
    models = tuple(parse_model_arg(m) for m in args.model)
    for name, path in models:
        if not Path(path).is_dir():
            raise GptjError(f"--model {name}={path}: no such model folder")
    adapters = tuple(parse_model_arg(a, "--lora") for a in args.lora_adapters)
    if adapters and (len(models) != 1 or args.ray or args.tp > 1 or args.pp > 1 or under_torchrun()):
        raise GptjError("--lora serves adapters over one --model, on one machine (not with --ray, --tp or --pp)")
    for name, path in adapters:
        from gptj.lora import read_config

        read_config(path)  # a folder that is not an adapter: one line now, before the base loads
        _warn_lora_base("serve", path, models[0][1])
    if args.ray:  # replicas resolve the folder themselves, on whichever node hosts them
        models = tuple((name, str(Path(path).resolve())) for name, path in models)
    cfg = _server_config(args, models, adapters)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"gptj serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    if not under_torchrun() and not (args.ray and args.address):  # (a joined cluster's proxy may hold it)
        from gptj.serve.server import check_port

        check_port(args.host, args.port)  # before anything loads: a port in use is one line
    if args.ray:
        _check_replica_ranks(args, [path for _, path in models])
    elif args.tp > 1 or args.pp > 1 or under_torchrun():
        if len(models) != 1 or args.admin_token:
            raise GptjError("--tp / --pp serve one model, given at start (no --admin-token)")
        _check_parallel(args.tp, args.pp, models[0][1])
        run_parallel(_serve_job, args.tp * args.pp, {"cfg": cfg, "tp": args.tp, "pp": args.pp,
                                                     "log_level": args.log_level, "debug": args.debug},
                     device=args.device)
        return 0
    if args.ray:
        from gptj.serve import ray_api

        if args.admin_token:
            raise GptjError("--admin-token is for the single-machine server; with --ray, use gptj publish "
                            "--ray-address")
        ray_api().run_server(cfg, args.address, replicas=args.replicas or 1, cpus=args.cpus_per_replica or 1.0,
                             gpus=args.gpus_per_replica or 0.0, tp=args.tp, pp=args.pp)
        return 0
    from dataclasses import replace

    from gptj.threads import RESERVED_CORES, compute_threads

    serve(replace(cfg, threads=compute_threads(args.threads, reserve=RESERVED_CORES)), log_level=args.log_level)
    return 0


def _check_replica_ranks(args: argparse.Namespace, paths: list[str]) -> None:
    """--tp / --pp inside Ray Serve replicas: each replica runs tp x pp ranks on its node."""
    world = args.tp * args.pp
    if world == 1:
        return
    for path in paths:
        if Path(path).is_dir():  # (a folder only the nodes have is checked there)
            _check_parallel(args.tp, args.pp, path)
    if args.device.startswith("cuda") and (args.gpus_per_replica or 0) < world:
        raise GptjError(f"--tp {args.tp} --pp {args.pp} on CUDA needs --gpus-per-replica {world} (one GPU per rank)")


def _serve_job(rank: int, world: int, payload: dict) -> None:
    """gptj serve --tp/--pp on one rank: rank 0 serves HTTP and leads; the others follow its engine
    (and leave signals to rank 0, which tells them to stop once it has drained)."""
    from gptj.parallel import lockstep
    from gptj.serve.server import serve

    if rank > 0:
        return lockstep.follower_job(rank, world, payload)
    lockstep.configure(payload["tp"], payload["pp"])
    try:
        serve(payload["cfg"], log_level=payload["log_level"])
    finally:
        lockstep.finish()
    return None


def cmd_train(args: argparse.Namespace) -> int:
    from gptj.train.config import load_config
    from gptj.train.trainer import train

    overrides = list(args.set or [])
    if args.out:
        overrides.append(f"out={args.out}")
    cfg = load_config(args.config, overrides)
    if args.eval_only or args.checkpoint:
        return _eval_only(args, cfg)
    record = train(cfg, stop_after=args.max_steps, resume=args.resume, progress=not args.quiet, device=args.device)
    from gptj.parallel.launch import under_torchrun

    if not under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())
        early = (f" (stopped at step {args.max_steps} of {cfg.max_steps}: --resume continues)"
                 if args.max_steps is not None and args.max_steps < cfg.max_steps else "")
        what = "adapter" if cfg.lora is not None else "model"
        print(f"trained to {shown or 'the last step'}{early}; {what}, checkpoints and metrics.jsonl in {cfg.out}")
    return 0


def _eval_only(args: argparse.Namespace, cfg) -> int:  # noqa: ANN001 - gptj.train.config.TrainConfig
    from gptj.parallel.launch import under_torchrun
    from gptj.train.trainer import evaluate_only

    if not args.eval_only:
        raise GptjError("--checkpoint goes with --eval-only (training starts from the config's model.checkpoint)")
    if args.resume or args.max_steps is not None:
        raise GptjError("--eval-only trains nothing: drop --resume / --max-steps")
    record = evaluate_only(cfg, args.checkpoint, progress=not args.quiet, device=args.device)
    if under_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(record))
    else:
        at = f" (step {record['step']})" if "step" in record else ""
        print(f"{record['checkpoint']}{at}: eval loss {record['eval_loss']:.4f}, perplexity {record['eval_ppl']:.4g}, "
              f"next-token accuracy {record['eval_accuracy']:.4f} over {record['eval_tokens']:,} target tokens")
    return 0


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    from gptj.serve.client import request_json

    return request_json(args.server, method, path, body, token=args.admin_token, timeout=args.timeout,
                        token_source="--admin-token or $GPTJ_ADMIN_TOKEN")


def _ray(args: argparse.Namespace):  # noqa: ANN202 - gptj.serve.ray_serve, connected
    from gptj.serve import ray_api

    module = ray_api()
    module.connect(args.ray_address)
    return module


_RAY_ONLY = ("replicas", "cpus_per_replica", "gpus_per_replica")


def cmd_publish(args: argparse.Namespace) -> int:
    if args.ray_address is None:
        for flag in _RAY_ONLY:
            if getattr(args, flag) is not None:
                raise GptjError(f"--{flag.replace('_', '-')} needs --ray-address (a single server has one engine "
                                f"per model)")
        if args.tp > 1 or args.pp > 1:
            raise GptjError("--tp / --pp need --ray-address (a running server keeps the plan it started with)")
        out = _admin_call(args, "POST", "/admin/models", {"name": args.name, "path": args.path})
        print(f"published {out['name']} ({out['status']})")
        return 0
    from gptj.serve import ray_api

    replicas = args.replicas or 1
    ray_api().check_publishable(args.name, replicas)
    _check_replica_ranks(args, [args.path])
    ray_serve = _ray(args)
    cfg = _server_config(args)
    path = str(Path(args.path).resolve()) if Path(args.path).is_dir() else args.path  # else: on the nodes only
    ray_serve.start_http(args.host, args.port)  # Serve's HTTP proxy, if it is not running yet
    ray_serve.ensure_gateway()
    ray_serve.publish(args.name, path, cfg, replicas=replicas, cpus=args.cpus_per_replica or 1.0,
                      gpus=args.gpus_per_replica or 0.0, tp=args.tp, pp=args.pp, timeout_s=args.timeout)
    print(f"published {args.name} ({replicas} replica{'s' * (replicas > 1)}, route /{args.name})")
    return 0


def cmd_unpublish(args: argparse.Namespace) -> int:
    if args.ray_address is not None:
        _ray(args).unpublish(args.name)
        print(f"unpublished {args.name}")
        return 0
    out = _admin_call(args, "DELETE", f"/admin/models/{args.name}")
    print(f"unpublished {out['name']}")
    return 0


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def cmd_ls(args: argparse.Namespace) -> int:
    from gptj.serve.client import request_json

    if args.ray_address is not None:
        models = _ray(args).list_models()
        if args.json:
            print(json.dumps(models, indent=2))
            return 0
        _print_table([("NAME", "REPLICAS", "STATUS", "ROUTE")] + [
            (m["name"], f"{m['replicas_running']}/{m['replicas_target']}", str(m["status"]), str(m["route"]))
            for m in models])
        return 0
    models = request_json(args.server, "GET", "/v1/models", token=args.api_key, timeout=args.timeout,
                          token_source="--api-key or $GPTJ_SERVER_API_KEY")["data"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    _print_table([("NAME", "STATUS", "MAX_LEN", "PATH")] + [
        (m["id"], m.get("status", "ready") + (f" ({m['error']})" if m.get("error") else ""),
         str(m.get("max_model_len", "")), m.get("root", "")) for m in models])
    return 0


def _generate_job(rank: int, world: int, payload: dict) -> list[list[int]]:
    """gptj generate's work on one rank (all of it when world is 1): load, shard, run the engine."""
    from gptj.parallel import lockstep
    from gptj.runtime.build import build_engine, load_model

    spec = payload["spec"]
    if world > 1:
        lockstep.configure(spec.tp, spec.pp)
    model = load_model(spec)
    # Every rank sizes its engine the same way (ranks must schedule identically): see build_engine.
    engine = build_engine(model, payload["engine"])
    return engine.generate(payload["prompts"], payload["gen"])


def _modes(text: str) -> list[str]:
    from gptj.quant import QUANT_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in QUANT_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(QUANT_MODES)}, got {text!r}")
    return modes


def cmd_quant_report(args: argparse.Namespace) -> int:
    from gptj.bench.quant_report import format_report, quantization_report
    from gptj.device import resolve_device
    from gptj.runtime.spec import ModelSpec

    dtype = ModelSpec(path=args.model, dtype=args.dtype, device=args.device).torch_dtype  # auto / fast as everywhere
    report = quantization_report(args.model, modes=args.modes, n_prompts=args.prompts, max_tokens=args.max_tokens,
                                 group_size=args.group_size, dtype=dtype,
                                 device=resolve_device(args.device), speed=args.speed)
    print(json.dumps(report, indent=2) if args.json else format_report(report).rstrip())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from gptj.bench.compare import compare, format_compare, gptj_side, hf_side
    from gptj.device import resolve_device

    if args.b is None and not args.hf and not args.quantize:
        raise GptjError("give a second model B, --hf (HF transformers on A) or --quantize MODE (A quantized on load)")
    if args.b is not None and args.hf:
        raise GptjError("give either a second model B or --hf, not both")
    if args.hf and args.quantize:
        raise GptjError("--quantize applies to B; with --hf, B is gptj's load of A: compare A A --quantize MODE "
                        "instead")
    from gptj.runtime.spec import ModelSpec

    # --dtype auto / fast resolve as every command's do (auto: A's checkpoint dtype)
    dtype = ModelSpec(path=args.a, dtype=args.dtype, device=args.device).torch_dtype
    device = resolve_device(args.device)
    tok = _tokenizer_for(args.a)
    prompts = [tok.encode(p) for p in args.prompt] + [list(ids) for ids in args.prompt_ids]
    if args.dataset or not prompts:
        from gptj.mlperf.dataset import Dataset

        prompts += Dataset.load(args.dataset, tokenizer=tok, max_examples=args.prompts).input_ids
    prompts = [p[:args.max_tokens] for p in prompts]
    for i, p in enumerate(prompts):
        if not p:
            raise GptjError(f"prompt {i + 1} is empty")
    if args.hf:
        a, b = hf_side(args.a, dtype, device), gptj_side(args.a, dtype, device, name=f"gptj on {args.a}")
    else:
        a = gptj_side(args.a, dtype, device, config=args.config)
        b = gptj_side(args.b or args.a, dtype, device, quantize=args.quantize, group_size=args.group_size,
                      config=args.config)
    report = compare(a, b, prompts, args.new_tokens, progress=_progress_line("compare"))
    print(json.dumps(report, indent=2) if args.json else format_compare(report).rstrip())
    return 0 if report["verdict"] == "agree" else EXIT_DIFFER


def _progress_line(command: str):  # noqa: ANN202 - (str) -> None
    """A step of a long command, said as it starts, on stderr (stdout keeps the result): `gptj
    compare: loading ... (12 s)`, with the seconds since the command began."""
    import time

    start = time.monotonic()

    def say(what: str) -> None:
        print(f"gptj {command}: {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    return say


def cmd_tokenize(args: argparse.Namespace) -> int:
    tok = _tokenizer(args.tokenizer)
    texts = args.text if args.text else [sys.stdin.read()]
    for text in texts:
        ids = tok.encode(text)
        print(json.dumps(ids) if args.json else ",".join(map(str, ids)))
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    tok = _tokenizer(args.tokenizer)
    if args.ids:
        rows = args.ids
    else:  # one sequence per line on stdin, as FasterTransformer's token converter reads a CSV
        rows = []
        for n, line in enumerate(sys.stdin, 1):
            if line.strip():
                try:
                    rows.append(_ids(line.strip().strip("[]")))
                except argparse.ArgumentTypeError as e:
                    raise GptjError(f"stdin line {n}: {e}") from None
    for ids in rows:
        text = tok.decode(ids)
        print(json.dumps(text, ensure_ascii=False) if args.json else text)
    return 0


def mlperf_config(args: argparse.Namespace):  # noqa: ANN201 - gptj.mlperf.config.MLPerfConfig
    """What `gptj mlperf` runs (its engine's size follows from it: gptj.mlperf.run.engine_config)."""
    from gptj.decode import GenerationConfig
    from gptj.mlperf.config import MLPerfConfig

    server = args.server
    if not args.model and not server:
        raise GptjError("give --model DIR to run in this process, or --server URL to run against a gptj server")
    gen = GenerationConfig.mlperf(num_beams=args.num_beams, min_new_tokens=args.min_new_tokens,
                                  max_new_tokens=args.max_new_tokens)
    return MLPerfConfig(
        model=Path(args.model) if args.model else None, scenario=args.scenario, mode=args.mode,
        dataset=Path(args.dataset) if args.dataset else None, max_examples=args.max_examples,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        user_conf=Path(args.user_conf) if args.user_conf else None, target_qps=args.target_qps,
        target_latency_ms=args.target_latency_ms, min_duration_ms=args.min_duration_ms,
        min_query_count=args.min_query_count, max_query_count=args.max_query_count,
        performance_sample_count=args.performance_sample_count, round=args.round,
        audit_config=Path(args.audit_config) if args.audit_config else None,
        max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
        gen=gen, spec=flags.model_spec(args), engine=flags.engine_config(args), threads=args.threads,
        progress=not args.quiet,
        argv=["gptj", *sys.argv[1:]] if args.argv is None else args.argv,
        server=server, server_model=args.server_model, server_concurrency=args.server_concurrency,
    )


def cmd_mlperf(args: argparse.Namespace) -> int:
    from gptj.mlperf.run import run
    from gptj.parallel.launch import run_parallel, under_torchrun

    cfg = mlperf_config(args)
    parallel = args.tp > 1 or args.pp > 1 or under_torchrun()
    if parallel:
        if args.server:
            raise GptjError("--tp / --pp split the model in this process; with --server, the server decides")
        _check_parallel(args.tp, args.pp, args.model)
    try:
        if parallel:
            ran = run_parallel(_mlperf_job, args.tp * args.pp, {"cfg": cfg, "tp": args.tp, "pp": args.pp,
                                                                "threads": args.threads, "debug": args.debug},
                               device=args.device)
            if isinstance(ran, dict) and "interrupted" in ran:
                raise KeyboardInterrupt(ran["interrupted"])
        else:
            _mlperf_report(run(cfg))
    except KeyboardInterrupt as e:
        # One line, exit 130 (as `gptj train`), and leave at once: an interpreter shutting down under
        # threads still in C++ (LoadGen's test when its schedule had time left, the engine loading or
        # stepping) crashes ("terminate called", SIGSEGV). What must be on disk is: our files are
        # written atomically and LoadGen's logs flushed before run() raised.
        print("gptj mlperf: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    return 0


def _check_parallel(tp: int, pp: int, model: str | Path) -> None:
    """Refuse a plan the model cannot take before any rank starts (the ranks check it again)."""
    if not (Path(model) / "config.json").is_file():
        return  # the loader says what is wrong with the folder
    from gptj.parallel.pp import check_split
    from gptj.parallel.tp import check_plan
    from gptj.weights.io import resolve_config

    config = resolve_config(model)
    if tp > 1:
        check_plan(config, tp)
    if pp > 1:
        check_split(config.n_layer, pp)


def _mlperf_job(rank: int, world: int, payload: dict) -> None:
    """gptj mlperf --tp/--pp on one rank: rank 0 runs LoadGen and the engine that leads the others."""
    from gptj.mlperf.run import run
    from gptj.parallel import lockstep

    if rank > 0:
        return lockstep.follower_job(rank, world, payload)

    def interrupt(signum, frame) -> None:  # noqa: ANN001 - the parent forwards Ctrl-C as SIGTERM
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    lockstep.configure(payload["tp"], payload["pp"])
    try:
        _mlperf_report(run(payload["cfg"]))
    except KeyboardInterrupt as e:  # run() stopped LoadGen's test cleanly; the parent says so
        return {"interrupted": str(e)}
    finally:
        lockstep.finish()
    return None


def cmd_submission(args: argparse.Namespace) -> int:
    import dataclasses

    from gptj.mlperf.rules import DEFAULT_ROUND
    from gptj.mlperf.submission import SubmissionConfig, submit

    shared = mlperf_config(args)
    if args.max_query_count is None:  # an official run has no cap (LoadGen logs one as an error)
        shared = dataclasses.replace(shared, max_query_count=0)
    sub = SubmissionConfig(
        out=Path(args.out), submitter=args.submitter, system_name=args.system_name, division=args.division,
        category=args.category, benchmark=args.benchmark, run=shared, round=args.round or DEFAULT_ROUND,
        runs_dir=Path(args.runs_dir) if args.runs_dir else None,
        system_desc=Path(args.system_desc) if args.system_desc else None,
        mlperf_inference=Path(args.mlperf_inference) if args.mlperf_inference else None,
        assemble_only=args.assemble_only, force=args.force)
    try:
        tree, checker = submit(sub, on_run=lambda planned, result: _mlperf_report(result))
    except KeyboardInterrupt as e:  # as gptj mlperf: one line, exit 130, leave at once
        print("gptj submission: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    print(f"submission: {tree}")
    if checker is None:
        print("not checked: give --mlperf-inference DIR (a checkout of github.com/mlcommons/inference) to run "
              "MLCommons' submission checker")
        return 0
    print(f"MLCommons' checker: {checker.summary} ({len(checker.errors)} error lines; its output: {checker.log})")
    return 0 if checker.passed else EXIT_CHECKER_ERRORS


def _mlperf_report(result) -> None:  # noqa: ANN001 - gptj.mlperf.run.RunResult
    from gptj.mlperf.evaluate import format_report

    if result.accuracy is not None:
        print(format_report(result.accuracy).rstrip())
    if result.result_line:
        print(result.result_line + (f" ({result.metric})" if result.metric else ""))
    for reason in getattr(result, "invalid_reasons", None) or []:
        print(f"  INVALID: {reason}")
    st = result.stats
    print(f"SUT: {st.samples} samples in {st.batches} batches (largest {st.max_batch})")
    if result.engine_times is not None:
        print(f"engine: {result.engine_times.line()}")
    print(f"logs and summary: {result.log_dir}/summary.md", flush=True)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from gptj.mlperf.dataset import DEFAULT_DATASET
    from gptj.mlperf.evaluate import evaluate_log, format_report, read_references, references_from_log

    if args.against:
        references = references_from_log(Path(args.against))
        result = evaluate_log(Path(args.log_dir), references, against=args.against)
    else:
        references = read_references(Path(args.dataset) if args.dataset else DEFAULT_DATASET)
        result = evaluate_log(Path(args.log_dir), references)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_report(result).rstrip())
    if not result.complete:  # an interrupted run: the scores are printed, but they are no result
        print(f"gptj evaluate: {result.incomplete_reason()}", file=sys.stderr)
        return EXIT_NOT_A_RESULT
    return 0


def _add_serving_flags(p) -> None:  # noqa: ANN001 - a parser or a group
    """What a served model runs with: gptj serve, and gptj publish on a Ray cluster."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_nonnegative, default=8000)
    p.add_argument("--batch-wait-ms", type=_nonnegative_float, default=0.0,
                   help="an idle engine waits this long for more requests before starting (default 0)")
    p.add_argument("--max-queue", type=_nonnegative, default=64,
                   help="requests queued beyond a full batch; more are refused with 429 (default 64)")
    p.add_argument("--request-timeout-s", type=_positive_float, default=600.0, help="per request (default 600)")
    p.add_argument("--drain-timeout-s", type=_positive_float, default=30.0,
                   help="on SIGTERM, how long running requests may finish (default 30)")
    p.add_argument("--read-timeout-s", type=_positive_float, default=30.0,
                   help="a connection must send each request's headers, then its body, within this; else it is "
                        "closed (a late body: 408) (default 30)")
    p.add_argument("--max-connections", type=_positive, default=512,
                   help="open connections (and running requests) at most; beyond, 503 (default 512)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes, /metrics and the API "
                                      "documents (/docs, /redoc, /openapi.json) (default: $GPTJ_SERVER_API_KEY "
                                      "if set; never empty)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key: serve /metrics without the key (a Prometheus scraper)")
    p.add_argument("--public-docs", action="store_true",
                   help="with --api-key: serve /docs, /redoc and /openapi.json without the key")
    flags.add_engine_flags(p, batch_alias=True, prefill_chunk=flags.SERVE_PREFILL_CHUNK,
                           max_seqs_help="sequences running at once, beams counted each (default: as many as the "
                                         "KV memory holds, at most 256)")
    # --dtype auto (every command's default): each model's checkpoint dtype, so a served answer is
    # `gptj generate`'s; --dtype fast serves bfloat16 where it runs fast (docs/PERFORMANCE.md)
    flags.add_model_flags(p, quantize_help="quantize the models' linears on load (weight-only)")
    flags.add_threads_flag(p, help="torch compute threads (default: the usable cores; on cores shared with other "
                        "work, fewer leave room for the event loop: docs/PERFORMANCE.md); "
                        "with --tp/--pp, split over the ranks (default: the cores split); with Ray, each "
                        "replica's (default: --cpus-per-replica)")


# Commands that choose their own thread count (they keep cores for threads beside the compute).
_OWN_THREADS = ("mlperf", "serve", "publish")


def _add_replica_flags(p) -> None:  # noqa: ANN001 - a parser or a group
    p.add_argument("--replicas", type=_positive, help="replicas of each model (default 1)")
    p.add_argument("--cpus-per-replica", type=_positive_float, help="Ray CPUs per replica, and its torch threads "
                                                                    "unless --threads (default 1)")
    p.add_argument("--gpus-per-replica", type=_nonnegative_float, help="Ray GPUs per replica (default 0)")


def _add_mlperf_run_flags(p) -> None:  # noqa: ANN001 - a parser
    """How `gptj mlperf` and `gptj submission` run LoadGen and the model."""
    p.add_argument("--dataset", help="cnn_eval.json (default: gptj's bundled sample set)")
    p.add_argument("--max-examples", type=_positive, help="use only the first N examples")
    p.add_argument("--target-qps", type=_positive_float, help="Offline expected / Server target QPS")
    p.add_argument("--target-latency-ms", type=_positive_float,
                   help="SingleStream expected / Server target latency")
    _add_run_length_flags(p)
    p.add_argument("--max-batch-size", type=_positive,
                   help="samples per batch (Offline/Server; default 8 on CPU; on CUDA 256 Offline, 64 Server)")
    p.add_argument("--batch-wait-ms", type=_nonnegative_float,
                   help="Server: how long a batch waits for more samples (default 40)")
    flags.add_engine_flags(p, max_seqs_help="sequences running at once (default: max-batch-size x num-beams, as "
                                            "the KV memory allows)")
    flags.add_model_flags(p)
    p.add_argument("--num-beams", type=_positive, default=4, help="official: 4")
    p.add_argument("--min-new-tokens", type=_nonnegative, default=30, help="official: 30")
    p.add_argument("--max-new-tokens", type=_positive, default=128, help="official: 128")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    flags.add_threads_flag(p)


def _add_run_length_flags(p) -> None:  # noqa: ANN001 - a parser
    """LoadGen's run-length settings, over its built-in mlperf.conf (gptj mlperf, gptj submission)."""
    p.add_argument("--min-duration-ms", type=_nonnegative, help="LoadGen min_duration_ms (official: 600000)")
    p.add_argument("--min-query-count", type=_positive,
                   help="LoadGen min_query_count (official: mlperf.conf's). LoadGen may raise it (equal issue: "
                        "whole passes over the performance samples; SingleStream: 2 x min duration / expected "
                        "latency) and the run issues what LoadGen asks; early stopping needs at least 64 "
                        "SingleStream or 459 Server queries for a VALID run")
    p.add_argument("--max-query-count", type=_nonnegative,
                   help="LoadGen max_query_count: stop a SingleStream or Server run there (default and 0: no cap; "
                        "below LoadGen's minimum the run is INVALID)")
    p.add_argument("--performance-sample-count", type=_positive,
                   help="LoadGen performance_sample_count_override (official: 13368; at most the data set's size)")
    p.add_argument("--round", metavar="VERSION", help="an MLPerf round's seeds (v5.0, the last round with GPT-J; "
                                                      "default: LoadGen's built-in mlperf.conf's)")


# --- parser ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from gptj import __version__
    from gptj.config import PRESETS
    parser = _Parser(prog="gptj", description="An exact, fast GPT-J 6B.")
    parser.add_argument("--version", action="version", version=f"gptj {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    p = sub.add_parser("init", help="write a model with deterministic random weights",
                       description="Write a model with deterministic random weights in the canonical format.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=_nonnegative, default=0)
    flags.add_dtype_flag(p)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("convert", help="convert a checkpoint to gptj's canonical (HF-compatible) format",
                       description="Convert an HF GPT-J directory or a mesh-transformer-jax slim checkpoint "
                                   "(step_383500/) to the canonical HF-compatible directory.")
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("--from", dest="fmt", choices=("auto", "hf", "mtj"), default="auto", help="source format")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    flags.add_dtype_flag(p, None, help="convert weights to this dtype (default: as stored)")
    p.add_argument("--config", help="for slim checkpoints: a preset name or config.json (default gptj-6b)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    flags.add_quantize_flags(p, "write quantized linears: int8 / int4 weight-only, w8a8, fp8 (a gptj-only format: HF transformers refuses it)")
    p.add_argument("--tp", type=_positive, help="also write per-rank tensor-parallel shards (tp{N}/rank{r}.safetensors)")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("calibrate", help="calibrate a float model for w8a8 (SmoothQuant factors)",
                       description="Run calibration prompts through the float model, record each linear's input "
                                   "|max| per channel, and store SmoothQuant's smoothing factors in the model folder "
                                   "(calibration.safetensors, recorded in config.json), so that --quantize w8a8 "
                                   "can load it. MLPerf's closed division allows calibrating on its calibration "
                                   "list (cnn_dailymail_calibration.json).")
    p.add_argument("--model", required=True, help="a float model directory (HF / gptj format); written to")
    p.add_argument("--dataset", help="prompts in cnn_eval.json's format (default: the bundled MLPerf sample set)")
    p.add_argument("--samples", type=_positive, help="use the first N (default: all)")
    p.add_argument("--alpha", type=_unit_interval, default=None,
                   help="migration strength: s = max|X|^alpha / max|W|^(1 - alpha) (default 0.5)")
    flags.add_dtype_flag(p, "auto", auto=True, help="the float model's dtype while calibrating: %(choices)s (default "
                                                    f"auto; {flags.DTYPE_RULES_HELP})")
    flags.add_device_flag(p)
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("generate", help="generate text from prompts",
                       description="Generate from one or more prompts (together they form one batch).")
    p.add_argument("--model", required=True, help="model directory (HF / gptj format)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--max-new-tokens", type=_positive, default=128)
    p.add_argument("--min-new-tokens", type=_nonnegative, default=0)
    p.add_argument("--num-beams", type=_positive, default=1)
    p.add_argument("--temperature", type=_nonnegative_float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=_nonnegative, default=0, help="0 = off")
    p.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling: keep the most likely tokens "
                                                                    "whose probabilities add up to this, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="HF's rule over prompt and output: a seen token's logit is divided by R where "
                        "positive, multiplied where negative (0.01 to 100; default 1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: a logit loses F times its token's count in the output (-2 to 2; default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: a logit loses P once its token is in the output (-2 to 2; default 0)")
    flags.add_model_flags(p)
    flags.add_lora_flag(p)
    flags.add_engine_flags(p, max_seqs_help="sequences running at once, beams counted each (default: all the "
                                            "prompts', as the KV memory allows; more wait)")
    flags.add_threads_flag(p)
    flags.add_parallel_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.add_argument("--stream", action="store_true",
                   help="print the text as its tokens come (each prompt in turn; not with --json or beams)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("mlperf", help="run the MLPerf gptj-99 benchmark with LoadGen",
                       description="Run MLPerf Inference gptj-99 (CNN-DailyMail summarization) with the real "
                                   "LoadGen. Accuracy runs score themselves; every run writes a results folder.")
    p.add_argument("--model", help="model directory (HF / gptj format); with --server optional: its tokenizer "
                                   "(default GPT-J's) and config for the notes")
    p.add_argument("--server", metavar="URL",
                   help="run the samples on a gptj server (e.g. http://127.0.0.1:8000) over HTTP instead of "
                        "loading a model here; a server API key is read from $GPTJ_SERVER_API_KEY")
    p.add_argument("--server-model", metavar="NAME", help="with --server: the served model (default: its only one)")
    p.add_argument("--server-concurrency", type=_positive, default=64, metavar="N",
                   help="with --server: requests in flight at once (default 64)")
    p.add_argument("--scenario", choices=("Offline", "Server", "SingleStream"), default="Offline")
    p.add_argument("--mode", choices=("performance", "accuracy"), default="accuracy")
    p.add_argument("--log-dir", help="results folder (default: mlperf-logs/<time>-<scenario>-<mode>)")
    p.add_argument("--user-conf", help="LoadGen user.conf (applied over the built-in mlperf.conf)")
    p.add_argument("--audit-config", metavar="FILE",
                   help="a compliance test's audit.config (MLCommons' compliance/TESTnn/); kept in the run's folder. "
                        "Without it, an audit.config in the working directory is ignored")
    _add_mlperf_run_flags(p)
    flags.add_parallel_flags(p)
    p.set_defaults(func=cmd_mlperf, argv=None)

    p = sub.add_parser("submission", help="make an MLPerf gptj submission: every run it needs, the official tree, "
                                          "MLCommons' checker",
                       description="Run what an MLPerf Inference gptj submission needs (each required scenario's "
                                   "performance and accuracy runs, and the closed division's compliance tests), "
                                   "reusing runs already made, and write the official tree <out>/<division>/"
                                   "<submitter>/. With --mlperf-inference, MLCommons' submission checker then "
                                   "checks it (exit 3 when it finds errors).")
    p.add_argument("--model", required=True, help="model directory (HF / gptj format)")
    p.add_argument("--out", required=True, help="the submission's root folder")
    p.add_argument("--submitter", required=True, help="the organization (names a folder)")
    p.add_argument("--system-name", required=True, help="the system (names systems/<name>.json and folders)")
    p.add_argument("--division", required=True, choices=("closed", "open"))
    p.add_argument("--category", required=True, choices=("edge", "datacenter"),
                   help="edge: SingleStream + Offline; datacenter: Server + Offline")
    p.add_argument("--benchmark", default="gptj-99", choices=("gptj-99", "gptj-99.9"))
    p.add_argument("--runs-dir", help="where the runs and their untruncated logs go (default: mlperf-runs/"
                                      "<system>-<benchmark>-<division>); runs already there are reused")
    p.add_argument("--system-desc", metavar="FILE",
                   help="the system description to complete (default: <runs-dir>/system_desc.json; when missing, "
                        "gptj writes what this machine says and names the fields left to fill). A file from "
                        "`mlperf-sysinfo capture` works too")
    p.add_argument("--mlperf-inference", metavar="DIR",
                   help="a checkout of github.com/mlcommons/inference: its compliance tests (the closed division "
                        "needs them) and its submission checker")
    p.add_argument("--assemble-only", action="store_true", help="run nothing: assemble the runs in --runs-dir "
                                                                 "(a missing, different or damaged run is an error)")
    p.add_argument("--force", action="store_true", help="replace an existing <out>/<division>/<submitter>")
    _add_mlperf_run_flags(p)
    p.set_defaults(func=cmd_submission, argv=None, scenario="Offline", mode="accuracy", log_dir=None, user_conf=None,
                   audit_config=None, server=None, server_model=None, server_concurrency=64)

    p = sub.add_parser("evaluate", help="score an MLPerf accuracy log (ROUGE)",
                       description="Score mlperf_log_accuracy.json as MLCommons' gptj evaluation does: ROUGE-1/2/L/"
                                   "Lsum, gen_len, gen_num, and pass/fail against the gptj-99 and gptj-99.9 targets.")
    p.add_argument("--log-dir", required=True, help="folder with mlperf_log_accuracy.json (or the file itself)")
    refs = p.add_mutually_exclusive_group()
    refs.add_argument("--dataset", help="cnn_eval.json the run used (default: gptj's bundled sample set)")
    refs.add_argument("--against", metavar="LOG_DIR",
                      help="score against another accuracy run's outputs instead (e.g. a quantized model's "
                           "summaries against bfloat16's: how close the two runs are)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_evaluate)

    from gptj.bench.latency import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("quant-report", help="accuracy of int8/int4/w8a8/fp8 quantization vs float32",
                       description="Teacher-forced next-token top-1 agreement and logit error of each "
                                   "quantization mode against the float32 model, on the first prompts of the "
                                   "bundled MLPerf sample set (and the unquantized model in --dtype as a yardstick). "
                                   "w8a8 needs a calibrated folder (gptj calibrate); calibrated on the same "
                                   "bundled prompts, its figures are in-sample. Each mode is also timed here "
                                   "with the serving kernels (one token; one prompt), and the CPU's kind and "
                                   "the W8A8 form it gets are named. fp8 runs on GPUs with FP8 units; "
                                   "elsewhere its math is emulated for the accuracy figures, untimed.")
    p.add_argument("--model", required=True, help="a float model directory (HF / gptj format)")
    p.add_argument("--modes", "--quantize", type=_modes, default=["int8", "int4"],
                   help="comma-separated (default: int8,int4)")
    p.add_argument("--no-speed", dest="speed", action="store_false",
                   help="skip timing each mode with the serving kernels on this machine")
    p.add_argument("--group-size", type=_positive, help=flags.GROUP_SIZE_HELP)
    p.add_argument("--prompts", type=_positive, default=8, help="how many prompts of the sample set (default 8)")
    p.add_argument("--max-prompt-tokens", dest="max_tokens", type=_positive, default=128, metavar="N",
                   help="prompt tokens kept per prompt, its first (default 128)")
    flags.add_deprecated_alias(p, "--max-tokens", "--max-prompt-tokens")
    flags.add_dtype_flag(p, "auto", auto=True, help="activations and float weights of the quantized models: "
                                                    f"%(choices)s (default auto; {flags.DTYPE_RULES_HELP})")
    flags.add_device_flag(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_quant_report)

    p = sub.add_parser("compare", help="how close two checkpoints' logits are (or one against HF transformers)",
                       description="Teacher-forced logits of model A and model B (any checkpoint gptj loads: HF, "
                                   "gptj's own, quantized, a mesh-transformer-jax slim checkpoint; B may be A "
                                   "quantized on load), or of A in HF transformers against gptj (--hf), on the "
                                   "bundled MLPerf prompts or your own, each continued greedily by A: max and mean "
                                   "|dlogit|, top-1 agreement and the first diverging greedy token, per prompt and "
                                   "overall, then a verdict against a tolerance set by the two sides' number "
                                   "formats (docs/COMPARE.md). Exits 0 when they agree, 3 when they differ.")
    p.add_argument("a", metavar="A", help="the reference model folder")
    p.add_argument("b", metavar="B", nargs="?", help="the model to check (default with --quantize: A)")
    p.add_argument("--hf", action="store_true", help="compare HF transformers' GPTJForCausalLM on A (the reference) "
                                                     "with gptj's load of A")
    p.add_argument("--config", help="for a slim checkpoint: a preset name or config.json (default gptj-6b)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_ids, metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--dataset", help="prompts in cnn_eval.json's format (the default when no --prompt is given: "
                                     "the bundled MLPerf sample set)")
    p.add_argument("--prompts", type=_positive, default=8, help="how many of the data set's prompts (default 8)")
    p.add_argument("--max-prompt-tokens", dest="max_tokens", type=_positive, default=128, metavar="N",
                   help="prompt tokens kept per prompt, its first (default 128)")
    flags.add_deprecated_alias(p, "--max-tokens", "--max-prompt-tokens")
    p.add_argument("--max-new-tokens", dest="new_tokens", type=_nonnegative, default=16, metavar="N",
                   help="greedy tokens A adds to each prompt, compared too (default 16)")
    flags.add_deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    flags.add_dtype_flag(p, "auto", auto=True,
                         help="both sides' float dtype: %(choices)s (default auto: A's checkpoint's, as its "
                              "config.json records it, float32 when it records none; fast: bfloat16 where it runs "
                              "fast, else float32)")
    flags.add_device_flag(p)
    flags.add_quantize_flags(p, "quantize B's linears on load")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("serve", help="serve models over HTTP (OpenAI completions API)",
                       description="An OpenAI-compatible server (POST /v1/completions, GET /v1/models, /health, "
                                   "/metrics) on gptj's engine. SIGTERM drains running requests, then exits.")
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]DIR",
                   help="a model folder to serve as NAME (default: the folder's name); repeatable")
    flags.add_lora_flag(p, served=True)
    _add_serving_flags(p)
    p.add_argument("--admin-token", help="enable POST/DELETE /admin/models with this bearer token (default: "
                                         "$GPTJ_ADMIN_TOKEN if set; never empty)")
    p.add_argument("--model-root", help="admin loads must lie under this folder (default: the working directory)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no log line per request (by default each request logs its status, latency and tokens)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    flags.add_parallel_flags(p)
    g = p.add_argument_group("Ray Serve (pip install -e \".[ray]\")")
    g.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: each model an application of --replicas replicas at /NAME, and the "
                        "OpenAI routes at /v1 routed by model name; Ctrl-C or SIGTERM removes them")
    g.add_argument("--address", help="the Ray cluster to join (HOST:PORT or auto; default: start a local one)")
    _add_replica_flags(g)
    p.set_defaults(func=cmd_serve)

    for name, what in (("publish", "load a model on a running server, or publish it on a Ray cluster"),
                       ("unpublish", "unload a model from a running server, or delete it from a Ray cluster"),
                       ("ls", "list the models of a running server or of a Ray cluster")):
        p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}. With --server: the "
                           "server's admin API (ls: GET /v1/models). With --ray-address: Ray Serve applications.")
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--server", help="a gptj server's base URL, e.g. http://127.0.0.1:8000")
        where.add_argument("--ray-address", help="a Ray cluster (HOST:PORT, or auto for the one on this machine)")
        p.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds to wait (default 600)")
        if name == "ls":
            p.add_argument("--api-key", help="the server's --api-key, if it has one (default: $GPTJ_SERVER_API_KEY)")
            p.add_argument("--json", action="store_true")
            p.set_defaults(func=cmd_ls)
            continue
        p.add_argument("name", help="the model's name")
        if name == "publish":
            p.add_argument("path", help="its checkpoint folder, on the server's machine (under its --model-root); "
                                        "on a Ray cluster, on every node that may host a replica")
            g = p.add_argument_group("with --ray-address: the replicas' settings (a --server uses its own)")
            _add_serving_flags(g)
            _add_replica_flags(g)
            flags.add_parallel_flags(g)
        p.add_argument("--admin-token", help="the server's --admin-token (default: $GPTJ_ADMIN_TOKEN)")
        p.set_defaults(func=cmd_publish if name == "publish" else cmd_unpublish)

    from gptj.train.data_cli import register as register_prepare_data

    register_prepare_data(sub)

    p = sub.add_parser("train", help="pre-train or fine-tune from a YAML config",
                       description="Pre-train or fine-tune a GPT-J from a YAML config (see examples/train/). Under "
                                   "torchrun --nproc-per-node N: data-parallel (distributed: ddp) or sharded "
                                   "(distributed: fsdp).")
    p.add_argument("--config", required=True, help="the YAML config")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optimizer.lr=1e-3 (repeatable)")
    p.add_argument("--out", help="output folder (overrides the config's out)")
    p.add_argument("--max-steps", type=_positive, help="stop after this step (the schedule still spans the "
                                                       "config's max_steps); --resume continues")
    p.add_argument("--resume", action="store_true", help="continue from the output folder's last checkpoint")
    p.add_argument("--eval-only", action="store_true",
                   help="train nothing: eval loss, perplexity and next-token accuracy of a checkpoint on the config's "
                        "eval set (the numbers training's evaluation reports for it)")
    p.add_argument("--checkpoint", metavar="DIR", help="with --eval-only: the model folder to evaluate (default: the "
                                                       "output folder's, the last step trained)")
    p.add_argument("--json", action="store_true", help="with --eval-only: print the result as one JSON object")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (under torchrun: one GPU per rank)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("tokenize", help="text to token ids", description="Text to GPT-J token ids.")
    p.add_argument("text", nargs="*", help="texts (default: all of stdin as one text)")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: GPT-J's)")
    p.add_argument("--json", action="store_true", help="print JSON lists")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids to text",
                       description="Token ids to text; ids as arguments, or one comma-separated row per stdin line.")
    p.add_argument("ids", nargs="*", type=_ids, help="comma-separated ids, one sequence per argument")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: GPT-J's)")
    p.add_argument("--json", action="store_true", help="print each text as a JSON string")
    p.set_defaults(func=cmd_detokenize)
    return parser


def _resolve_secrets(args: argparse.Namespace) -> None:
    """--api-key and --admin-token, wherever a command has them: the flag, else its environment
    variable (gptj.serve.auth); an empty or blank one is refused here, in one line (exit 2)."""
    from gptj.serve.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, secret

    for name, env in (("api_key", API_KEY_ENV), ("admin_token", ADMIN_TOKEN_ENV)):
        if name in vars(args):
            setattr(args, name, secret(getattr(args, name), f"--{name.replace('_', '-')}", env))


def _exit_now(code: int) -> None:
    """End the process now, its output flushed, without the interpreter's teardown: after a drained
    server stops, freeing the model's tensors, torch's and OpenMP's state one object at a time took
    0.9 s of a 1.1 s exit on SIGTERM for the tiny model (more for bigger ones), and there is nothing
    left to save (the drain answered every request; no file is open for writing)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is not None and "argv" in vars(args) and args.argv is None:
        args.argv = ["gptj", *argv]  # the command a run records (run.json, a submission's README)
    try:
        _resolve_secrets(args)
        if getattr(args, "threads", None) is not None and args.command not in _OWN_THREADS:
            from gptj.threads import set_threads

            set_threads(args.threads)
        code = args.func(args)
        if argv is None and args.command == "serve" and not args.ray:
            _exit_now(code)  # the `gptj` command: a drained server ends here
        return code
    except GptjError as e:
        if args.debug:
            traceback.print_exc()
        print(f"gptj {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"gptj {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gptj tokenize ... | head`): stop quietly, as `cat` does
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except MemoryError:
        print(f"gptj {args.command}: error: out of memory (try --dtype bfloat16)", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as e:  # noqa: BLE001 - a bug, not user input: one line unless --debug
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"gptj {args.command}: internal error: {type(e).__name__}: {msg} (rerun with --debug for details)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
