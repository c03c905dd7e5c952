"""`gptj mlperf`, `gptj submission` and `gptj evaluate`: MLPerf's gptj-99 and llama3.1-8b runs, a
gptj submission's tree of them, and the scoring of an accuracy log."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from gptj.cli.common import check_parallel
from gptj.errors import GptjError
from gptj.mlperf.rules import RUN_BENCHMARKS, SUBMISSION_BENCHMARKS
from gptj.runtime import flags

EXIT_CHECKER_ERRORS = 3  # gptj submission: the tree is written; MLCommons' checker found errors in it
EXIT_NOT_A_RESULT = 3  # gptj evaluate: scored, but the log did not answer every sample of its run


def mlperf_config(args: argparse.Namespace):  # noqa: ANN201 - gptj.mlperf.config.MLPerfConfig
    """What `gptj mlperf` runs (its engine's size follows from it: gptj.mlperf.run.engine_config)."""
    from gptj.mlperf.config import choose_benchmark

    if not args.model and not args.server:
        raise GptjError("give --model DIR to run in this process, or --server URL to run against a gptj server")
    return run_config(
        args, benchmark=choose_benchmark(args.benchmark, args.model), scenario=args.scenario, mode=args.mode,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        user_conf=Path(args.user_conf) if args.user_conf else None,
        audit_config=Path(args.audit_config) if args.audit_config else None,
        server=args.server, server_model=args.server_model, server_concurrency=args.server_concurrency)


def run_config(args: argparse.Namespace, **own: Any):  # noqa: ANN201 - gptj.mlperf.config.MLPerfConfig
    """The run that the flags `gptj mlperf` and `gptj submission` share (_add_mlperf_run_flags) ask
    for; `own` holds what only `gptj mlperf` sets (a submission leaves it at MLPerfConfig's defaults:
    each of its runs gets its own scenario, mode and folder). The generation flags not given are the
    benchmark's (gptj-99: 4 beams, 30-128 new tokens; llama3.1-8b: greedy, 1-128)."""
    from gptj.decode import GenerationConfig
    from gptj.mlperf.config import MLPerfConfig, llama_generation
    from gptj.mlperf.rules import LLAMA_BENCHMARKS

    given = {k: v for k in ("num_beams", "min_new_tokens", "max_new_tokens") if (v := getattr(args, k)) is not None}
    given |= flags.speculation(args)  # --speculate ngram: the open division's (check_division refuses it in closed)
    gen = llama_generation(**given) if own.get("benchmark") in LLAMA_BENCHMARKS else GenerationConfig.mlperf(**given)
    return MLPerfConfig(
        model=Path(args.model) if args.model else None,
        dataset=Path(args.dataset) if args.dataset else None, max_examples=args.max_examples,
        target_qps=args.target_qps, target_latency_ms=args.target_latency_ms, min_duration_ms=args.min_duration_ms,
        min_query_count=args.min_query_count, max_query_count=args.max_query_count,
        performance_sample_count=args.performance_sample_count, round=args.round,
        max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
        gen=gen, spec=flags.model_spec(args), engine=flags.engine_config(args), threads=args.threads,
        progress=not args.quiet,
        argv=["gptj", *sys.argv[1:]] if args.argv is None else args.argv,
        **own,
    )


def cmd_mlperf(args: argparse.Namespace) -> int:
    """Run MLPerf Inference gptj-99 or llama3.1-8b (CNN-DailyMail summarization) with the real LoadGen. Accuracy
    runs score themselves; every run writes a results folder."""
    from gptj.mlperf.run import run
    from gptj.parallel.launch import run_parallel, under_torchrun

    cfg = mlperf_config(args)
    parallel = args.tp > 1 or args.pp > 1 or under_torchrun()
    if parallel:
        if args.server:
            raise GptjError("--tp / --pp split the model in this process; with --server, the server decides")
        check_parallel(args.tp, args.pp, args.model)
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
        _leave_interrupted("mlperf", e)
    return 0


def _leave_interrupted(command: str, e: KeyboardInterrupt) -> NoReturn:
    """One line, exit 130 (as `gptj train`), and leave at once: an interpreter shutting down under
    threads still in C++ (LoadGen's test when its schedule had time left, the engine loading or
    stepping) crashes ("terminate called", SIGSEGV). What must be on disk is: our files are
    written atomically and LoadGen's logs flushed before run() raised."""
    print(f"gptj {command}: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def _mlperf_job(rank: int, world: int, payload: dict) -> None:
    """gptj mlperf --tp/--pp on one rank: rank 0 runs LoadGen and the engine that leads the others."""
    import signal

    from gptj.mlperf.run import run
    from gptj.parallel import lockstep
    from gptj.parallel.context import ParallelContext

    if rank > 0:
        return lockstep.follower_job(rank, world, payload)

    def interrupt(signum, frame) -> None:  # noqa: ANN001 - the parent forwards Ctrl-C as SIGTERM
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    ctx = ParallelContext.join(payload["tp"], payload["pp"])
    try:
        _mlperf_report(run(payload["cfg"], ctx))
    except KeyboardInterrupt as e:  # run() stopped LoadGen's test cleanly; the parent says so
        return {"interrupted": str(e)}
    finally:
        lockstep.finish(ctx)
    return None


def cmd_submission(args: argparse.Namespace) -> int:
    """Run what an MLPerf Inference submission of gptj-99 (round v5.0) or llama3.1-8b / llama3.1-8b-edge (round
    v6.1) needs (each scenario's performance and accuracy runs, and the closed division's compliance tests),
    reusing runs already made, and write the official tree <out>/<division>/<submitter>/. With
    --mlperf-inference, MLCommons' submission checker then checks it (exit 3 when it finds errors)."""
    import copy
    import dataclasses

    from gptj.mlperf.config import choose_benchmark
    from gptj.mlperf.rules import LLAMA_BENCHMARKS
    from gptj.mlperf.submission import SubmissionConfig, submit

    args.benchmark = choose_benchmark(args.benchmark, args.model)  # left out: the folder's architecture's
    llama = args.benchmark in LLAMA_BENCHMARKS
    run_args = copy.copy(args)
    if llama:  # --round names the submission's round; a llama run takes LoadGen's seeds (checked to be its)
        run_args.round = None
    shared = run_config(run_args, benchmark=args.benchmark)  # a model folder of the other architecture: refused
    if args.max_query_count is None:  # an official run has no cap (LoadGen logs one as an error)
        shared = dataclasses.replace(shared, max_query_count=0)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip()) if args.scenarios else None
    sub = SubmissionConfig(
        out=Path(args.out), submitter=args.submitter, system_name=args.system_name, division=args.division,
        category=args.category, benchmark=args.benchmark, run=shared, round=args.round, scenarios=scenarios,
        runs_dir=Path(args.runs_dir) if args.runs_dir else None,
        system_desc=Path(args.system_desc) if args.system_desc else None,
        mlperf_inference=Path(args.mlperf_inference) if args.mlperf_inference else None,
        assemble_only=args.assemble_only, force=args.force)
    try:
        tree, checker = submit(sub, on_run=lambda planned, result: _mlperf_report(result))
    except KeyboardInterrupt as e:
        _leave_interrupted("submission", e)
    print(f"submission: {tree}")
    if checker is None:
        print("not checked: give --mlperf-inference DIR (a checkout of github.com/mlcommons/inference) to run "
              "MLCommons' submission checker")
        return 0
    print(f"MLCommons' checker: {checker.summary} ({len(checker.errors)} error lines; its output: {checker.log})")
    return 0 if checker.passed else EXIT_CHECKER_ERRORS


def _mlperf_report(result) -> None:  # noqa: ANN001 - gptj.mlperf.run.RunResult
    from gptj.mlperf.report import accuracy_report

    if result.accuracy is not None:
        print(accuracy_report(result.accuracy).rstrip())
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
    """Score mlperf_log_accuracy.json as MLCommons' gptj evaluation does: ROUGE-1/2/L/Lsum, gen_len, gen_num,
    and pass/fail against the gptj-99 and gptj-99.9 targets (--benchmark llama3.1-8b[-edge]: as its
    evaluation.py does, against its targets, decoding with --tokenizer)."""
    from gptj.mlperf.dataset import DEFAULT_DATASET
    from gptj.mlperf.evaluate import evaluate_log, format_report, read_references, references_from_log

    if args.benchmark != "gptj-99":
        return _evaluate_llama(args)
    if args.log_dtype != "int64":
        raise GptjError(f"--log-dtype {args.log_dtype} is for llama3.1-8b logs: gptj-99's token ids are int64")
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


def _evaluate_llama(args: argparse.Namespace) -> int:
    """`gptj evaluate --benchmark llama3.1-8b[-edge]`: MLCommons' llama3.1-8b evaluation.py's scores."""
    from gptj.mlperf import evaluate_llama
    from gptj.mlperf.dataset import DEFAULT_LLAMA_DATASET, load_llama_records
    from gptj.tokenizer import load_tokenizer

    if args.against:
        raise GptjError(f"--against scores gptj-99 runs only, not {args.benchmark}")
    if not args.tokenizer:
        raise GptjError(f"--benchmark {args.benchmark} needs --tokenizer: the Llama checkpoint folder (or its "
                        "tokenizer.json) whose tokenizer decodes the log's token ids")
    records = load_llama_records(Path(args.dataset) if args.dataset else DEFAULT_LLAMA_DATASET)
    result = evaluate_llama.evaluate_log(Path(args.log_dir), [r.output for r in records],
                                         load_tokenizer(args.tokenizer), benchmark=args.benchmark,
                                         dtype=args.log_dtype)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(evaluate_llama.accuracy_line(result))
        print(evaluate_llama.format_report(result).rstrip())
    if not result.complete:
        print(f"gptj evaluate: the accuracy log answers {result.scores['gen_num']:,} of the "
              f"{result.expected_samples:,} samples: these scores are not a result", file=sys.stderr)
        return EXIT_NOT_A_RESULT
    return 0


def _add_mlperf_run_flags(p, round_help: str | None = None) -> None:  # noqa: ANN001 - a parser
    """How `gptj mlperf` and `gptj submission` run LoadGen and the model."""
    p.add_argument("--dataset", help="cnn_eval.json (default: gptj's bundled sample set)")
    p.add_argument("--max-examples", type=flags.positive, help="use only the first N examples")
    p.add_argument("--target-qps", type=flags.positive_float, help="Offline expected / Server target QPS")
    p.add_argument("--target-latency-ms", type=flags.positive_float,
                   help="SingleStream expected / Server target latency")
    _add_run_length_flags(p, round_help)
    p.add_argument("--max-batch-size", type=flags.positive,
                   help="samples per batch (Offline/Server; default 8 on CPU; on CUDA 256 Offline, 64 Server)")
    p.add_argument("--batch-wait-ms", type=flags.nonnegative_float,
                   help="Server: how long a batch waits for more samples (default 40)")
    flags.add_engine_flags(p, max_seqs_help="sequences running at once (default: max-batch-size x num-beams, as "
                                            "the KV memory allows)")
    flags.add_model_flags(p)
    p.add_argument("--num-beams", type=flags.positive, help="official: gptj-99 4, llama3.1-8b 1 (greedy)")
    p.add_argument("--min-new-tokens", type=flags.nonnegative, help="official: gptj-99 30, llama3.1-8b 1")
    p.add_argument("--max-new-tokens", type=flags.positive, help="official: 128")
    flags.add_speculate_flags(p)  # the open division only: MLPerf's closed division forbids speculative decoding
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    flags.add_threads_flag(p)


def _add_run_length_flags(p, round_help: str | None = None) -> None:  # noqa: ANN001 - a parser
    """LoadGen's run-length settings, over its built-in mlperf.conf (gptj mlperf, gptj submission)."""
    p.add_argument("--min-duration-ms", type=flags.nonnegative, help="LoadGen min_duration_ms (official: 600000)")
    p.add_argument("--min-query-count", type=flags.positive,
                   help="LoadGen min_query_count (official: mlperf.conf's). LoadGen may raise it (equal issue: "
                        "whole passes over the performance samples; SingleStream: 2 x min duration / expected "
                        "latency) and the run issues what LoadGen asks; early stopping needs at least 64 "
                        "SingleStream or 459 Server queries for a VALID run")
    p.add_argument("--max-query-count", type=flags.nonnegative,
                   help="LoadGen max_query_count: stop a SingleStream or Server run there (default and 0: no cap; "
                        "below LoadGen's minimum the run is INVALID)")
    p.add_argument("--performance-sample-count", type=flags.positive,
                   help="LoadGen performance_sample_count_override (official: 13368; at most the data set's size)")
    p.add_argument("--round", metavar="VERSION", help=round_help or "an MLPerf round's seeds (v5.0, the last round "
                                                                    "with GPT-J; default: LoadGen's built-in "
                                                                    "mlperf.conf's)")


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `mlperf`, `submission` and `evaluate` to `sub`."""
    p = sub.add_parser("mlperf", help="run the MLPerf gptj-99 or llama3.1-8b benchmark with LoadGen",
                       description=cmd_mlperf.__doc__)
    p.add_argument("--model", help="model directory (HF / gptj format); with --server optional: its tokenizer "
                                   "(default GPT-J's) and config for the notes")
    p.add_argument("--server", metavar="URL",
                   help="run the samples on a gptj server (e.g. http://127.0.0.1:8000) over HTTP instead of "
                        "loading a model here; a server API key is read from $GPTJ_SERVER_API_KEY")
    p.add_argument("--server-model", metavar="NAME", help="with --server: the served model (default: its only one)")
    p.add_argument("--server-concurrency", type=flags.positive, default=64, metavar="N",
                   help="with --server: requests in flight at once (default 64)")
    p.add_argument("--benchmark", choices=RUN_BENCHMARKS,
                   help="default: the model's (gptj-99 for GPT-J, llama3.1-8b for Llama; gptj-99.9 runs as gptj-99 "
                        "and is scored against both). llama3.1-8b: datacenter, Offline, Server, Interactive; "
                        "llama3.1-8b-edge: Offline, SingleStream")
    p.add_argument("--scenario", choices=("Offline", "Server", "SingleStream", "Interactive"), default="Offline",
                   help="Interactive: llama3.1-8b's Server with tighter token latency limits")
    p.add_argument("--mode", choices=("performance", "accuracy"), default="accuracy")
    p.add_argument("--log-dir", help="results folder (default: mlperf-logs/<time>-<scenario>-<mode>)")
    p.add_argument("--user-conf", help="LoadGen user.conf (applied over the built-in mlperf.conf)")
    p.add_argument("--audit-config", metavar="FILE",
                   help="a compliance test's audit.config (MLCommons' compliance/TESTnn/); kept in the run's folder. "
                        "Without it, an audit.config in the working directory is ignored")
    _add_mlperf_run_flags(p)
    flags.add_parallel_flags(p)
    p.set_defaults(func=cmd_mlperf, argv=None)

    p = sub.add_parser("submission", help="make an MLPerf gptj-99 or llama3.1-8b submission: every run it needs, "
                                          "the official tree, MLCommons' checker",
                       description=cmd_submission.__doc__)
    p.add_argument("--model", required=True, help="model directory (HF / gptj format)")
    p.add_argument("--out", required=True, help="the submission's root folder")
    p.add_argument("--submitter", required=True, help="the organization (names a folder)")
    p.add_argument("--system-name", required=True, help="the system (names systems/<name>.json and folders)")
    p.add_argument("--division", required=True, choices=("closed", "open"))
    p.add_argument("--category", choices=("edge", "datacenter"),
                   help="gptj-99: edge (SingleStream + Offline) or datacenter (Server + Offline); llama3.1-8b is "
                        "datacenter, llama3.1-8b-edge edge (the default for them)")
    p.add_argument("--benchmark", choices=SUBMISSION_BENCHMARKS,
                   help="gptj-99 (round v5.0, the last with GPT-J) or gptj-99.9 for a GPT-J folder; llama3.1-8b / "
                        "llama3.1-8b-edge (round v6.1, the newest of MLCommons' checker) for a Llama-3.1-8B folder "
                        "(default: gptj-99 for GPT-J, llama3.1-8b for Llama)")
    p.add_argument("--scenarios", metavar="LIST",
                   help="comma-separated, for llama3.1-8b: Offline and Server and/or Interactive (default "
                        "Offline,Server); the others run their round's required scenarios (the default)")
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
    _add_mlperf_run_flags(p, round_help="the MLPerf round (default: gptj-99 v5.0, the last round with GPT-J, whose "
                                        "seeds its runs set; llama3.1-8b v6.1, the newest of MLCommons' checker, "
                                        "whose seeds are LoadGen's built-in ones)")
    p.set_defaults(func=cmd_submission, argv=None)

    p = sub.add_parser("evaluate", help="score an MLPerf accuracy log (ROUGE)", description=cmd_evaluate.__doc__)
    p.add_argument("--log-dir", required=True, help="folder with mlperf_log_accuracy.json (or the file itself)")
    refs = p.add_mutually_exclusive_group()
    refs.add_argument("--dataset", help="cnn_eval.json the run used (default: gptj's bundled sample set)")
    refs.add_argument("--against", metavar="LOG_DIR",
                      help="score against another accuracy run's outputs instead (e.g. a quantized model's "
                           "summaries against bfloat16's: how close the two runs are)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--benchmark", default="gptj-99", choices=("gptj-99", "llama3.1-8b", "llama3.1-8b-edge"),
                   help="whose scoring and targets (gptj-99 also checks gptj-99.9; llama3.1-8b's data set is its "
                        "cnn_eval.json format, default: gptj's bundled llama stand-in)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="llama3.1-8b: the checkpoint folder (or tokenizer.json) whose tokenizer decodes the log")
    p.add_argument("--log-dtype", choices=("int64", "int32"), default="int64",
                   help="llama3.1-8b: the log's token id type, the reference evaluation.py's --dtype (default int64, "
                        "as its; `gptj mlperf --benchmark llama3.1-8b` writes int32, as the reference SUT does)")
    p.set_defaults(func=cmd_evaluate)
