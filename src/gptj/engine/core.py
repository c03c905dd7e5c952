"""The engine: requests in, tokens out, one `step()` at a time.

    schedule   engine/scheduler.py    what runs: decode rows, prefill chunks, admissions (plain data)
    run        engine/runner.py       the forward passes over paged KV memory -> one logits tensor and
                                      whose rows they are
    batch      engine/input_batch.py  the decode rows, kept from step to step and brought up to each
                                      step from what the scheduler changed
    update     engine/update.py       next tokens (engine/sampler.py), beams, prefix-cache entries;
                                      retire the finished
    kv         engine/kv.py           block tables, reference counts, the prefix cache

Greedy, sampled and beam-search requests share every step. Each request attends over its own
blocks only, so its tokens do not depend on what else shares the step (up to float rounding;
equal tokens in float32 in the tests). The engine takes the model as it is given: preparing
serving kernels (gptj.kernels.prepare_for_serving) is the caller's (gptj.runtime.build).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from gptj.decode import GenerationConfig, check_prompts
from gptj.engine.config import EngineConfig, EngineStats, KVPlan, StepTimes, plan_kv
from gptj.engine.kv import KVCacheManager
from gptj.engine.request import (ABORTED, FAILED, FINISHED, RUNNING, WAITING, AbortRequest, AddRequest, Request,
                                 Status, TokenLogprob)
from gptj.engine.runner import ModelRunner
from gptj.engine.scheduler import Scheduler
from gptj.engine.update import Updater, token_logprobs
from gptj.errors import GptjError
from gptj.models.gptj import GPTJForCausalLM
from gptj.threads import ThreadTuner, tuner_for

__all__ = ["ABORTED", "FAILED", "FINISHED", "RUNNING", "WAITING", "Engine", "EngineConfig", "Request", "Status",
           "TokenLogprob", "token_logprobs"]


class Engine:
    def __init__(self, model: GPTJForCausalLM, config: EngineConfig | None = None, plan: KVPlan | None = None) -> None:
        """plan: the KV plan made for this model and config (gptj.runtime.build.plan_for, within the
        memory free at load); None: plan_kv's now."""
        self.model = model
        self.config = config = config or EngineConfig()
        w = model.transformer.wte.weight
        self.device = w.device
        self.plan = plan or plan_kv(model.config, w.dtype, w.device, config, n_head=model.kv_heads)
        self.kv = KVCacheManager(self.plan.n_blocks, self.plan.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.kv, self.plan, config)
        self.runner = ModelRunner(model, self.plan, config)
        self.requests: dict[str, Request] = {}
        self.times = StepTimes()
        self.updater = Updater(self.kv, self.scheduler, self.runner.batch, self.requests, self.device, self.times)
        self.adapters: list[str] = list(getattr(model, "lora_names", []))  # LoRA adapters (gptj.lora.attach_adapters)
        self._ids = itertools.count()
        self.decode_batch_sizes: list[int] = []  # sequences per decode forward, for stats and tests
        self.tuner: ThreadTuner | None = None  # the compute threads' chooser (CPU), made at the first step

    @property
    def steps(self) -> int:
        """Steps run (since the start, or since warm)."""
        return self.times.steps

    # --- the step ---

    def step(self) -> list[Request]:
        """Run one step: decode every running sequence, prefill what the schedule says; return the
        requests that finished in it."""
        return self._step()

    def _step(self) -> list[Request]:
        """The step itself (`probe` runs it before the engine is handed out, past hooks on `step`)."""
        tuner = self._thread_tuner()
        times, t0, cpu0 = self.times, time.perf_counter(), time.process_time()
        scheduled = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.run(scheduled)
        t2 = time.perf_counter()
        if result.decode_rows:
            self.decode_batch_sizes.append(result.decode_rows)
        times.steps += 1
        times.decode_rows += result.decode_rows
        waited = times.wait
        finished = self.updater.apply(scheduled, result)  # adds the sampler's wait to times.wait
        times.schedule += t1 - t0
        times.forward += t2 - t1
        t3 = time.perf_counter()
        times.update += t3 - t2 - (times.wait - waited)
        if scheduled.prefill:
            times.prefill_steps += 1
            times.prefill_seconds += t3 - t0
        if tuner is not None and result.decode_rows and not scheduled.prefill:  # decode steps compare alike
            tuner.observe((id(self.model), result.decode_rows.bit_length()), t3 - t0,
                          time.process_time() - cpu0)
        return finished

    def _thread_tuner(self) -> ThreadTuner | None:
        """On a CPU, with config.adapt_threads: the tuner of this engine's compute threads, taken at the
        first step on the thread that steps (gptj.threads.tuner_for: its thread count is the most it
        tries; an engine before this one on the thread hands on what it learned), and torch set to the
        count it chooses for this step. Steps are compared per model and decode rows."""
        if not self.config.adapt_threads or self.device.type != "cpu":
            return None
        if self.tuner is None:
            self.tuner = tuner_for(torch.get_num_threads())
        if torch.get_num_threads() != self.tuner.threads:
            torch.set_num_threads(self.tuner.threads)
        return self.tuner

    def warm(self, gen: GenerationConfig, prompt_len: int = 32) -> int:
        """Before timed work: run one short request of `gen`'s kind on a made-up prompt (the device's
        kernels compiled, the sampler's and prefill's paths taken) and make the CUDA graphs of every
        batch size for its rows per group. The KV blocks are freed after it. -> graphs' buckets warmed.

        The prompt takes every path a run's requests take (tests/test_warm_compiles.py records what
        each would compile on a GPU): a last block left partial (beams copy it on write), and with
        prompts prefilled in chunks, a chunk after the first (attention over the blocks in place)."""
        B, chunk = self.plan.block_size, self.config.prefill_chunk
        n = max(prompt_len, chunk + 1 if chunk else 0)
        n += n % B == 0  # a partial last block
        prompt = [(gen.eos_ids or (0,))[0]] * max(1, min(n, self.plan.max_len - 2))
        self.generate([prompt], dataclasses.replace(gen, max_new_tokens=2, min_new_tokens=0))
        warmed = self.runner.graphs.warm(gen.num_beams) if self.runner.graphs is not None else 0
        self._forget()
        return warmed

    def probe(self, prompt: Seq[int] = (0, 1, 2, 3)) -> None:
        """Before serving: one greedy token of a short prompt with the base model and with each LoRA
        adapter; GptjError (one line) if any gives logits that are not finite. A checkpoint whose
        weights are finite but too large overflows here, at load, instead of on its first request.
        Nothing of it stays (KV blocks, prefix cache, counters)."""
        gen = GenerationConfig(max_new_tokens=1, eos_token_id=None, pad_token_id=0)  # ids in any vocabulary
        for adapter in [None, *self.adapters]:
            req = self.add_request(list(prompt), gen, logprobs=0, adapter=adapter)
            while not req.done:
                self._step()
            lp = req.token_logprobs[0].logprob if req.token_logprobs else math.nan
            if req.status == FAILED or not math.isfinite(lp):
                what = "the model" if adapter is None else f"LoRA adapter {adapter!r}"
                self._forget()
                raise GptjError(f"{what} gives logits that are not finite (NaN or infinity) on a probe prompt: its "
                                f"weights overflow {self.model.transformer.wte.weight.dtype} (a damaged or mis-scaled "
                                "checkpoint?)")
        self._forget()

    def _forget(self) -> None:
        """Drop what warm-up or a probe left: cached KV blocks, counters, step times."""
        self.kv.forget()
        self.updater.prefill_tokens = 0
        self.decode_batch_sizes.clear()
        self.times.reset()  # in place (the updater holds it): steps from 0 again

    # --- requests ---

    def validate(self, prompt: Seq[int], gen: GenerationConfig, logprobs: int | None = None,
                 adapter: str | None = None) -> None:
        """GptjError unless the request can ever run here (thread-safe: reads only configuration)."""
        check_prompts(self.model, [prompt], gen)
        if adapter is not None and adapter not in self.adapters:
            raise GptjError(f"no LoRA adapter {adapter!r} here (adapters: {', '.join(self.adapters) or 'none'})")
        plan = self.plan
        if logprobs is not None and gen.num_beams > 1:
            raise GptjError("logprobs are not available with beam search")
        if len(prompt) + gen.max_new_tokens > plan.max_len:
            raise GptjError(f"prompt of {len(prompt)} tokens + max_new_tokens {gen.max_new_tokens} exceeds the "
                            f"engine's {plan.max_len} tokens per sequence")
        if gen.num_beams > plan.max_seqs:
            raise GptjError(f"num_beams {gen.num_beams} exceeds the engine's {plan.max_seqs} sequences at once")
        if self.blocks_needed(len(prompt), gen) > plan.n_blocks:
            raise GptjError(f"a prompt of {len(prompt)} tokens with max_new_tokens {gen.max_new_tokens} and "
                            f"{gen.num_beams} beam(s) needs {self.blocks_needed(len(prompt), gen)} KV blocks of "
                            f"{plan.block_size} tokens; the engine has {plan.n_blocks}")

    def blocks_needed(self, prompt_len: int, gen: GenerationConfig) -> int:
        """The most blocks a request can ever hold at once: the prompt's full blocks (shared by its
        beams), and each beam's own from there to its last token."""
        shared = prompt_len // self.plan.block_size
        return shared + gen.num_beams * (self.kv.blocks_for(prompt_len + gen.max_new_tokens) - shared)

    def add_request(self, prompt: Seq[int], gen: GenerationConfig, request_id: str | None = None,
                    on_token: Callable[[Request, int], None] | None = None,
                    on_finish: Callable[[Request], None] | None = None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    adapter: str | None = None) -> Request:
        """Validate and queue a request. `logprobs` / `prompt_logprobs` (top-k, 0 for the chosen token
        only) ask for log-probabilities of the new tokens (not with beam search) / of the prompt's.
        `adapter`: one of self.adapters to run it with (None: the base model)."""
        self.validate(prompt, gen, logprobs, adapter)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.apply(AddRequest(rid, [int(t) for t in prompt], gen, logprobs, prompt_logprobs, adapter),
                          on_token, on_finish)

    def apply(self, op: AddRequest | AbortRequest, on_token: Callable[[Request, int], None] | None = None,
              on_finish: Callable[[Request], None] | None = None) -> Request | None:
        """Apply an operation from a loop or a parallel job's leader (an AddRequest was validated at
        the door: EngineLoop.submit or add_request)."""
        if isinstance(op, AbortRequest):
            self.abort(op.request_id)
            return None
        if op.request_id in self.requests:
            raise GptjError(f"request id {op.request_id!r} is already in use")
        req = Request(op.request_id, list(op.prompt), op.gen, on_token, on_finish, logprobs=op.logprobs,
                      prompt_logprobs=op.prompt_logprobs,
                      adapter=self.adapters.index(op.adapter) if op.adapter is not None else -1)
        if op.gen.sampling and op.gen.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(op.gen.seed)
        self.requests[op.request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        self.updater.retire(req, ABORTED, "abort")
        return True

    # --- state ---

    @property
    def attention(self):  # noqa: ANN201 - gptj.engine.attention.AttentionBackend
        return self.runner.attention

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Request]:
        return list(self.scheduler.running)

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.kv
        return EngineStats(waiting=len(s.waiting), running=len(s.running), running_seqs=s.running_seqs,
                           max_seqs=self.plan.max_seqs, max_len=self.plan.max_len, blocks_total=kv.n_blocks,
                           blocks_free=kv.free, blocks_cached=kv.cached, prefix_queried_tokens=kv.queried_tokens,
                           prefix_hit_tokens=kv.hit_tokens, preemptions=s.preemptions,
                           stalls=s.stalls, prefill_tokens=self.updater.prefill_tokens, steps=self.steps,
                           draft_tokens=self.updater.drafted, accepted_tokens=self.updater.accepted,
                           times=dataclasses.replace(self.times),
                           threads=self.tuner.threads if self.tuner is not None else 0,
                           thread_steps=tuple(sorted(dict(self.tuner.steps_at).items())) if self.tuner is not None else ())

    # --- offline use ---

    def generate(self, prompts: Seq[Seq[int]], gen: GenerationConfig | Seq[GenerationConfig]) -> list[list[int]]:
        """New tokens of every prompt (one GenerationConfig for all, or one each), run to completion."""
        gens = [gen] * len(prompts) if isinstance(gen, GenerationConfig) else list(gen)
        if len(gens) != len(prompts):
            raise GptjError(f"{len(prompts)} prompts but {len(gens)} generation configs")
        reqs = [self.add_request(p, g) for p, g in zip(prompts, gens)]
        while any(not r.done for r in reqs):
            self.step()
        failed = [r for r in reqs if r.status == FAILED]
        if failed:
            raise GptjError(f"generation failed: {failed[0].error}")
        return [r.output for r in reqs]
