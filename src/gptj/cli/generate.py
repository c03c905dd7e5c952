"""`gptj generate`: text from prompts, all at once or streamed, on one rank or several."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gptj.cli.common import add_prompt_flags, check_parallel, tokenizer_for, warn_lora_base
from gptj.errors import GptjError
from gptj.runtime import flags


def generate_setup(args: argparse.Namespace):  # noqa: ANN201 - (tokenizer, prompts, gen, spec, engine config)
    """What `gptj generate` runs: its tokenizer, prompts (token ids), GenerationConfig, ModelSpec and
    EngineConfig (its prompts all at once, as the KV memory allows; the rest wait). Sequences may be
    as long as the model's context (the KV blocks a beam search takes beyond its sequences' own
    length, for its shared prompt, fit then; plan_kv bounds them by the free memory)."""
    from gptj.decode import GenerationConfig

    if not args.prompt and not args.prompt_ids:
        raise GptjError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    tok = tokenizer_for(args.model)
    gen = GenerationConfig(  # EOS (any of them ends a sequence) and padding: the model's tokenizer's
        eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, num_beams=args.num_beams,
        do_sample=args.temperature > 0, temperature=args.temperature,
        top_k=args.top_k or None, top_p=args.top_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, **flags.speculation(args),
    )
    if gen.prompt_lookup_num_tokens and not gen.speculates:  # said once: the flag does nothing for them
        print(f"gptj generate: note: --speculate drafts for greedy and sampled requests without penalties; "
              f"this {gen.method} run decodes as it would without it", file=sys.stderr)
    prompts = [tok.encode(p) for p in args.prompt] + [list(ids) for ids in args.prompt_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise GptjError(f"prompt {i + 1} is empty")
    engine = flags.engine_config(args, max_seqs=len(prompts) * gen.num_beams)
    return tok, prompts, gen, flags.model_spec(args), engine


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from one or more prompts (together they form one batch)."""
    from gptj.parallel.launch import NOT_RANK0, run_parallel, under_torchrun

    tok, prompts, gen, spec, engine = generate_setup(args)
    check_parallel(spec.tp, spec.pp, spec.path)
    if spec.lora is not None:
        warn_lora_base("generate", spec.lora, spec.path)
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


def _generate_job(rank: int, world: int, payload: dict) -> list[list[int]]:
    """gptj generate's work on one rank (all of it when world is 1): load, shard, run the engine."""
    from gptj.parallel.context import SINGLE, ParallelContext
    from gptj.runtime.build import build_engine, load_model

    spec = payload["spec"]
    ctx = ParallelContext.join(spec.tp, spec.pp) if world > 1 else SINGLE
    model = load_model(spec, ctx)
    # Every rank sizes its engine the same way (ranks must schedule identically): see build_engine.
    engine = build_engine(model, payload["engine"], ctx=ctx)
    return engine.generate(payload["prompts"], payload["gen"])


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `generate` to `sub`."""
    p = sub.add_parser("generate", help="generate text from prompts", description=cmd_generate.__doc__)
    p.add_argument("--model", required=True, help="model directory (HF / gptj format)")
    add_prompt_flags(p)
    p.add_argument("--max-new-tokens", type=flags.positive, default=128)
    p.add_argument("--min-new-tokens", type=flags.nonnegative, default=0)
    p.add_argument("--num-beams", type=flags.positive, default=1)
    p.add_argument("--temperature", type=flags.nonnegative_float, default=0.0,
                   help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=flags.nonnegative, default=0, help="0 = off")
    p.add_argument("--top-p", type=flags.probability, default=1.0,
                   help="nucleus sampling: keep the most likely tokens whose probabilities add up to this, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="HF's rule over prompt and output: a seen token's logit is divided by R where "
                        "positive, multiplied where negative (0.01 to 100; default 1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: a logit loses F times its token's count in the output (-2 to 2; default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: a logit loses P once its token is in the output (-2 to 2; default 0)")
    flags.add_speculate_flags(p)
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
