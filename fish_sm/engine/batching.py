"""Continuous batching: many requests share every decode step of one model.

One thread runs the model. Between two decode steps it admits waiting requests into
free KV-cache slots (their prompts prefilled together, padded, and their first frames
sampled in one replay) and retires the ones that finished; each step then decodes one
frame for every admitted request at once, so the weights read for a frame serve the
whole batch. Requests keep everything that makes them theirs: sampling parameters, seed
(their own random stream, drawn as the sequential engine draws it, so a request gives the
same codes batched or alone in float32; bf16 GPU kernels of other batch sizes round
differently), stop token, length, long text spoken chunk by chunk. A second thread turns
codes into audio on its own CUDA stream, overlapping the decoding: pieces as frames
arrive (streaming) or the whole utterance at the end.

KV memory is allotted in slots, one sequence of `max_seq_len` each, as many as fit the free
GPU memory. Active requests occupy slots 0..n-1 (a finishing request's slot is refilled
by moving the last one into it), so a step runs the smallest captured batch size that holds
them and its attention reads up to the longest one's bucketed length. A waiting queue
of bounded length holds the rest; beyond it `submit` refuses at once (`Overloaded`).

The prompt part made of reference voices is the same for every request that uses them:
its KV cache is computed once and copied into a slot (`PrefixCache`), so admitting a
request with a packaged voice prefills only its own text.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from fish_sm.engine import sampling_kernels
from fish_sm.engine.codec_stream import CodecStream, StreamingCodec
from fish_sm.engine.engine import (DEFAULT_CHUNK_LENGTH, Engine, Reference, Synthesis, check_text,
                                   request_generator)
from fish_sm.engine.generate import (GraphedStep, HostCopy, admission_shape, admission_shapes, attention_bucket,
                                     batch_sizes, decode_frame, frame_budget, noise_size, sample_frame, to_device)
from fish_sm.engine.prompt import build_prompt, chunk_prompt, prompt_prefix
from fish_sm.contract import SamplingParams
from fish_sm.engine.sampling import PENALTY_WINDOW, sampling_tensors
from fish_sm.engine.sampling_kernels import exponential_noise, noise_key
from fish_sm.engine.text import split_text
from fish_sm.errors import FishSMError, InputError
from fish_sm.model.dual_ar import cache_rows, copy_cache_rows

logger = logging.getLogger("fish_sm.batching")


class Overloaded(FishSMError):
    """Every slot is busy and the waiting queue is full."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStopped(FishSMError):
    """The engine no longer serves: it was stopped, or one of its threads failed."""


@dataclass(frozen=True)
class Job:
    """One request for the batching engine."""

    text: str
    references: tuple[Reference, ...] = ()
    chunk_length: int = DEFAULT_CHUNK_LENGTH
    params: SamplingParams = SamplingParams()
    stream: bool = False  # audio in pieces as frames are decoded (see codec_stream), else the whole at the end


# What a ticket's sink receives, in this order: ("admitted", None) when it leaves the queue
# for a slot, ("audio", float32 samples) any number of times (once, when not streaming), then
# ("done", Synthesis without audio) or ("error", exc); an error may also come first.
Event = tuple[str, object]


class Ticket:
    """A submitted job: its events go to `sink` (called from the engine's threads), or,
    without one, to a queue read by `events()`. `cancel()` frees its slot at the next step."""

    def __init__(self, job: Job, sink: Callable[[Event], None] | None = None):
        self.job = job
        self.cancelled = False
        self.bounded = True  # counts against the engine's max_queue while it waits
        self.submitted = time.perf_counter()
        self.timings: dict[str, float] = {}
        self._queue: queue.SimpleQueue | None = None
        if sink is None:
            self._queue = queue.SimpleQueue()
            sink = self._queue.put
        self._sink = sink

    def cancel(self) -> None:
        self.cancelled = True

    def emit(self, kind: str, payload) -> None:
        if not self.cancelled:
            self._sink((kind, payload))

    def events(self):
        """Blocking iteration over the events (only without a sink)."""
        while True:
            kind, payload = self._queue.get()
            yield kind, payload
            if kind in ("done", "error"):
                return

    def result(self) -> Synthesis:
        """Wait for the whole utterance (blocking; only without a sink)."""
        pieces, summary = [], None
        for kind, payload in self.events():
            if kind == "error":
                raise payload
            if kind == "audio":
                pieces.append(payload)
            elif kind == "done":
                summary = payload
        summary.audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return summary


class PrefixCache:
    """KV caches of prompt prefixes (the reference voices' part), least recently used out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # key -> `cache_rows` of the prefix: k, v of each layer in turn, cloned
        self._entries: collections.OrderedDict[tuple, list[Tensor]] = collections.OrderedDict()

    def get(self, key: tuple):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, kv: list[Tensor]) -> None:
        if self.capacity < 1:
            return
        self._entries[key] = kv
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


@dataclass
class _Request:
    """A ticket's state inside the engine thread."""

    ticket: Ticket
    chunks: list[str]
    generator: torch.Generator
    slot: int = -1
    draws: int = 0  # frames of noise drawn so far (the counter of `sampling_kernels.noise_key`)
    chunk: int = -1  # index into chunks; -1 before the first prefill
    length: int = 0  # prompt tokens of the current chunk
    max_new: int = 0
    computed: int = 0  # frames of this chunk computed (queued) so far
    finished_chunk: bool = True  # no more frames wanted from this chunk
    codes: list[np.ndarray] = field(default_factory=list)  # this chunk's frames, [C] each
    previous: list[tuple[str, Tensor]] = field(default_factory=list)
    spoken: list[np.ndarray] = field(default_factory=list)  # the frames of all finished chunks

    @property
    def params(self) -> SamplingParams:
        return self.ticket.job.params


class BatchEngine:
    """Iteration-level scheduling over an `Engine`'s model (which it takes over: the
    KV cache is re-made with one row per slot)."""

    def __init__(self, engine: Engine, max_batch: int = 64, max_queue: int | None = None,
                 prefix_cache: int = 8, memory_fraction: float = 0.9, first_piece: int = 4, largest_piece: int = 64,
                 codec_precision: str = "auto"):
        self.engine, self.model = engine, engine.model
        self.device = engine.device
        model, c = self.model, engine.config
        self.rows = 1 + c.num_codebooks
        self.max_seq_len = model.max_seq_len
        self._codec = CodecWorker(engine, first_piece, largest_piece, codec_precision)
        self.slots = self._fit_slots(max_batch, memory_fraction, prefix_cache)
        model.setup_caches(self.slots, self.max_seq_len)
        engine._step = None  # the sequential engine's graphs point at the old cache
        self.max_queue = self.slots if max_queue is None else max_queue
        self.batch_sizes = batch_sizes(self.slots)
        dev = self.device
        self.current = torch.zeros(self.slots, self.rows, dtype=torch.long, device=dev)  # each slot's last frame
        self.history = torch.zeros(self.slots, self.rows, self.max_seq_len + PENALTY_WINDOW, dtype=torch.long, device=dev)
        self.sampling = torch.ones(3, self.slots, 1, device=dev)  # temperature, top_p, penalty per slot
        self.noise = torch.ones(self.slots, noise_size(model), device=dev)
        # On CUDA a step's noise is one kernel keyed by each request's seed and frame number
        # (`sampling_kernels.exponential_noise`); on the CPU each request's generator draws it,
        # as the sequential engine does, so that the two give the same codes.
        self.keyed_noise = sampling_kernels.usable(dev)
        self.window_offsets = torch.arange(PENALTY_WINDOW, device=dev)
        self.prefixes = PrefixCache(prefix_cache)
        self._step = None
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: list[_Request] = []  # _active[i].slot == i
        self._lock = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the engine thread, if it failed
        self._decoded: list[tuple[Ticket, np.ndarray]] = []  # checked frames not yet handed to the codec
        self.steps = 0
        # The decode loop's CUDA stream, of high priority: the codec's large kernels (on a
        # stream of their own) would otherwise hold the SMs that each of a decode step's ~1,100
        # small kernels waits for, stretching every stream's frames.
        self.decode_stream = torch.cuda.Stream(dev, priority=-1) if dev.type == "cuda" else None

    def _fit_slots(self, max_batch: int, memory_fraction: float, prefix_cache: int) -> int:
        """Admission control: as many sequences as the free GPU memory holds (after room for
        the prefix cache, the captured graphs and the codec's largest batch), at most `max_batch`."""
        if self.device.type != "cuda":
            return max_batch
        c, dtype = self.engine.config, self.engine.model.dtype
        per_token = 2 * c.n_layer * c.n_local_heads * c.head_dim * torch.finfo(dtype).bits // 8
        per_slot = per_token * self.max_seq_len + self.rows * (self.max_seq_len + PENALTY_WINDOW) * 8
        codec = self._codec.codec.working_bytes()
        torch.cuda.empty_cache()  # the measurement's blocks, cached, would count as used below and in `codec` too
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = (1 - memory_fraction) * total + prefix_cache * per_token * self.max_seq_len // 4 + (2 << 30) + codec
        fit = int((free - reserve) // per_slot)
        if fit < 1:
            raise FishSMError(f"no room for a single {self.max_seq_len}-token KV cache on {self.device} "
                              f"({free / 2**30:.1f} GiB free); lower FISH_SM_MAX_SEQ_LEN")
        slots = min(max_batch, fit)
        logger.info("batching: %d slots of %d tokens (%.2f GiB each; %d asked for, %d fit) in %.1f GiB free, "
                    "keeping %.1f GiB for graphs, prefixes and the codec (%.1f GiB)", slots, self.max_seq_len,
                    per_slot / 2**30, max_batch, fit, free / 2**30, reserve / 2**30, codec / 2**30)
        return slots

    # -- lifecycle ------------------------------------------------------------------

    def compile(self) -> None:
        """Capture the decode step for every batch size and attention bucket, the admissions
        and the codec (CUDA), now rather than on a request."""
        if self.device.type != "cuda":
            return
        step = GraphedStep(self.model, max_batch=self.slots)
        t0 = time.perf_counter()
        step.capture_all(self.batch_sizes)
        self._compile_admissions()
        for batch, width in admission_shapes(self.slots, self.max_seq_len, PREFILL_TOKENS):
            step.capture_admission(batch, width)
        self._step = step
        self._check_admissions()
        self._codec.capture(pieces=12)  # the rest of a long utterance's pieces are captured when first reached
        # The warm-up runs before each capture leave blocks cached: hand back what no graph holds.
        torch.cuda.empty_cache()
        logger.info("batching: captured %d decode, %d admission and %d codec graphs in %.1f s; %.1f GiB of %.1f "
                    "GiB free", len(step.graphs), len(step.admissions), len(self._codec.codec.graphs),
                    time.perf_counter() - t0, *(b / 2**30 for b in torch.cuda.mem_get_info(self.device)))

    @torch.inference_mode()
    def _check_admissions(self) -> None:
        """Three prompts through a captured admission and through the compiled layers must
        agree (bf16 tolerance), or captured admissions are turned off, logged, rather than
        serve wrong frames (a first version captured with 1-D positions gave NaN for several
        rows on an H100 while one row was right)."""
        texts = ("One.", "A second, somewhat longer prompt.", "The third.")[: min(3, self.slots)]
        _, captured, compiled = self._admissions_both_ways(
            [build_prompt(self.engine.tokenizer, self.engine.config.num_codebooks, [], t) for t in texts])
        if not torch.allclose(captured, compiled, atol=0.5, rtol=0):
            logger.warning("batching: captured admissions disagree with the compiled layers (largest logit "
                           "difference %s); admitting through the compiled layers", (captured - compiled).abs().max().item())
            self._step.admissions.clear()

    @torch.inference_mode()
    def _admissions_both_ways(self, prompts: list[Tensor]) -> tuple[list[int], Tensor, Tensor]:
        """Prompts from position 0 admitted into slots 0.. (before serving), through a
        captured admission and through the compiled layers: the padded [batch, width] and
        each way's logits [prompts, vocab] in float32."""
        inputs = self._admission_inputs([(_Slot(i, p.shape[1]), p, 0) for i, p in enumerate(prompts)])
        captured, compiled = (self._admission(*inputs, captured=c)[0][: len(prompts)].float().clone() for c in (True, False))
        return list(inputs[0].shape[::2]), captured, compiled

    @torch.inference_mode()  # as the decode loop runs them
    def _compile_admissions(self) -> None:
        """Compile the admissions' prefill (`compile_layers`) for one prompt and for several,
        the two cases the compiled code tells apart, before a request waits on it. It writes
        into slots that are free."""
        model, dev, width = self.model, self.device, 16
        for batch in sorted({1, min(2, self.slots)}):
            tokens = torch.zeros(batch, self.rows, width, dtype=torch.long, device=dev)
            positions = torch.arange(width, device=dev).expand(batch, width)
            self._admission(tokens, positions, torch.arange(batch, device=dev),
                            torch.full((batch,), width - 1, device=dev), width, from_zero=True, captured=False)

    def start(self) -> "BatchEngine":
        # The decode loop and the codec thread hand the GIL to each other many times a
        # frame; Python's default 5 ms switch interval would stall the loop behind the codec.
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        self._running = True
        if self.decode_stream is not None:  # after the set-up work queued on this thread's stream
            self.decode_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._codec.start()
        self._thread = threading.Thread(target=self._loop, name="fish-sm-batching", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._codec.stop()
        if self.decode_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- the public side ---------------------------------------------------------------

    def submit(self, job: Job, sink: Callable[[Event], None] | None = None, bounded: bool = True) -> Ticket:
        """Queue a job; raises `Overloaded` at once when no slot and no queue place is free.
        `bounded=False` queues it beyond `max_queue`, for a caller that keeps at most one job
        waiting at a time (the lines of a JSON Lines body): it never takes another client's place."""
        check_text(job.text, job.chunk_length)
        ticket = Ticket(job, sink)
        ticket.bounded = bounded
        with self._lock:
            if not self.alive():
                raise EngineStopped("the batching engine is not running" if self.failure is None else
                                    f"the batching engine stopped after an internal error ({type(self.failure).__name__})")
            waiting = sum(t.bounded for t in self._waiting)
            if bounded and waiting >= self.slots - len(self._active) + self.max_queue:
                raise Overloaded(f"all {self.slots} slots are busy and {self.max_queue} requests wait already",
                                 retry_after_s=1)
            self._waiting.append(ticket)
            self._lock.notify_all()
        return ticket

    def alive(self) -> bool:
        """Both threads running: false for good once either has failed."""
        return (self._running and self._thread is not None and self._thread.is_alive() and self._codec.alive()
                and self.failure is None)

    def load(self) -> dict:
        with self._lock:
            return {"slots": self.slots, "active": len(self._active), "waiting": len(self._waiting),
                    "max_queue": self.max_queue}

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        """The engine thread. Whatever escapes the loop (a bug, not a request's problem) stops
        the engine: every request it holds fails and `alive()` turns false, so the server
        reports unhealthy and the platform replaces it, rather than hanging on requests."""
        try:
            self._serve()
        except BaseException as exc:  # logged here; the thread then ends quietly
            logger.exception("the batching engine failed; it serves no more requests")
            self._stop_serving(exc)

    def _stop_serving(self, exc: BaseException) -> None:
        with self._lock:
            self.failure, self._running = exc, False
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._lock.notify_all()
        error = EngineStopped(f"the batching engine stopped after an internal error ({type(exc).__name__})")
        for request in list(self._active):
            request.ticket.emit("error", error)
        self._active.clear()
        for ticket in waiting:
            ticket.emit("error", error)

    def _serve(self) -> None:
        pending: list[tuple[_Request, int, int, int, HostCopy]] = []  # (request, chunk, frame index, row, copy)
        on_stream = torch.cuda.stream(self.decode_stream) if self.decode_stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:
            while True:
                with self._lock:
                    while self._running and not self._waiting and not self._active and not pending:
                        self._lock.wait()
                    if not self._running:
                        break
                    if not self._codec.alive():
                        raise EngineStopped("the codec worker has stopped")
                    arrivals, refused = self._take_waiting()
                for ticket, exc in refused:
                    ticket.emit("error", exc)
                try:
                    for request in arrivals:
                        self._admit(request)
                    # New requests and those moving on to their next chunk of text, prefilled together.
                    self._start_chunks([r for r in self._active if r.finished_chunk and not r.ticket.cancelled
                                        and r.chunk + 1 < len(r.chunks)], pending)
                    step = self._decode_step()
                    pending = self._check(pending, step)
                except Exception as exc:  # a failure of the shared step fails every request in it
                    logger.exception("batching step failed")
                    if self.device.type == "cuda" and isinstance(exc, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    for request in list(self._active):
                        self._fail(request, exc)
                    pending = []
        for request in list(self._active):
            self._fail(request, FishSMError("the server is shutting down"))
        for ticket in self._waiting:
            ticket.emit("error", FishSMError("the server is shutting down"))

    def _take_waiting(self) -> tuple[list[_Request], list[tuple[Ticket, Exception]]]:
        """Waiting tickets moved into free slots (under the lock), and those whose own
        text or parameters could not be set up, with why: they fail alone."""
        taken, refused = [], []
        while self._waiting and len(self._active) < self.slots:
            ticket = self._waiting.popleft()
            if ticket.cancelled:
                continue
            try:
                request = _Request(ticket, split_text(ticket.job.text, ticket.job.chunk_length),
                                   request_generator(self.device, ticket.job.params.seed), slot=len(self._active))
            except Exception as exc:
                refused.append((ticket, exc))
                continue
            self._active.append(request)
            taken.append(request)
        return taken, refused

    def _admit(self, request: _Request) -> None:
        request.ticket.timings["queue"] = time.perf_counter() - request.ticket.submitted
        request.ticket.emit("admitted", None)
        p = request.params
        self.sampling[:, request.slot] = to_device(torch.stack(sampling_tensors(p, "cpu")).view(3, 1), self.device)

    def _start_chunks(self, requests: list[_Request], pending: list) -> None:
        """Prefill each request's next chunk into its slot and sample that chunk's first frame:
        the prompts padded into batches of at most `PREFILL_TOKENS`, each one prefill and one
        first-frame replay. A request whose prompt fails fails alone, after the others started
        (retiring it moves another request's slot)."""
        failed, ready = [], []
        for request in requests:
            request.chunk += 1
            try:
                prompt = chunk_prompt(self.engine.tokenizer, self.engine.config.num_codebooks, self.max_seq_len,
                                      self._references(request), request.previous, request.chunks[request.chunk])
                max_new = frame_budget(prompt.shape[1], self.max_seq_len, request.params.max_new_tokens)
                start = self._reuse_prefix(request, prompt)
            except (InputError, torch.cuda.OutOfMemoryError) as exc:
                failed.append((request, exc))
                continue
            request.length, request.max_new, request.computed = prompt.shape[1], max_new, 1
            request.finished_chunk, request.codes = False, []
            ready.append((request, prompt, start))
        ready.sort(key=lambda item: (item[2] > 0, item[1].shape[1] - item[2]))  # from position 0 first, shortest first
        groups = _prefill_groups(ready, self._admission_shape)
        while groups:
            group = groups.pop(0)
            try:
                self._prefill_batch(group, pending)
            except torch.cuda.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                if len(group) > 1:  # again one at a time, each failing on its own
                    groups[:0] = [[item] for item in group]
                else:
                    failed.append((group[0][0], exc))
        for request, exc in failed:
            self._fail(request, exc)

    def _references(self, request: _Request) -> list[tuple[str, Tensor]]:
        return [(r.text, r.codes) for r in request.ticket.job.references]

    def _reuse_prefix(self, request: _Request, prompt: Tensor) -> int:
        """Put the KV cache of the prompt's reference part into the request's slot (from the
        prefix cache, or computed and kept there); returns how many positions it covers."""
        references = self._references(request)
        if not references:
            return 0
        model, slot = self.model, request.slot
        caches = [block.attention.kv_cache for block in model.layers]
        key = tuple((text, hashlib.sha256(codes.numpy().tobytes()).hexdigest()) for text, codes in references)
        kv = self.prefixes.get(key)
        if kv is None:
            prefix = prompt_prefix(self.engine.tokenizer, self.engine.config.num_codebooks, references)
            n = prefix.shape[1]
            model.forward_slow(to_device(prefix, self.device)[None], model.positions[:n], n, row=slot)
            kv = [t.clone() for t in cache_rows(caches, slot, n)]
            self.prefixes.put(key, kv)
        else:
            torch._foreach_copy_(cache_rows(caches, slot, kv[0].shape[1]), kv)
        return kv[0].shape[1]

    def _admission_shape(self, batch: int, width: int) -> tuple[int, int]:
        """The (batch, width) prompts from position 0 are padded to: a captured admission's on CUDA."""
        return (batch, width) if self._step is None else admission_shape(batch, width, self.slots, self.max_seq_len)

    def _admission_inputs(self, group: list[tuple[_Request, Tensor, int]]) -> tuple:
        """Tokens, positions, cache rows and last positions of the prompts' rests (after any
        reused prefix), each padded at its end with its last token (whose keys land after the
        prompt, where decoding overwrites them before a query may see them); and the slots
        in use once they are written. Prompts all from position 0 are padded to
        `_admission_shape`, spare rows repeating the first prompt (the same values written
        into its row again)."""
        rests = [prompt[:, start:] for _, prompt, start in group]
        starts = [start for _, _, start in group]
        width = max(rest.shape[1] for rest in rests)
        batch, width = self._admission_shape(len(group), width) if not any(starts) else (len(group), width)
        rests += rests[:1] * (batch - len(group))
        starts += starts[:1] * (batch - len(group))
        tokens = torch.stack([torch.cat([rest, rest[:, -1:].expand(-1, width - rest.shape[1])], dim=1) for rest in rests])
        positions = (torch.tensor(starts)[:, None] + torch.arange(width)).clamp(max=self.max_seq_len - 1)
        rows = torch.tensor([r.slot for r, _, _ in group] + [group[0][0].slot] * (batch - len(group)))
        last = torch.tensor([rest.shape[1] - 1 for rest in rests])
        return (*(to_device(t, self.device) for t in (tokens, positions, rows, last)),
                max(r.length for r, _, _ in group), not any(starts))

    def _admission(self, tokens: Tensor, positions: Tensor, rows: Tensor, last: Tensor, live: int, from_zero: bool,
                   captured: bool = True):
        """The slow transformer over padded prompts: a captured admission's replay where
        there is one (prompts from position 0), else the compiled layers (eagerly on CPU)
        attending over the `live` slots in use; from position 0, causally over their own."""
        if captured and from_zero and self._step is not None and (tokens.shape[0], tokens.shape[-1]) in self._step.admissions:
            return self._step.admit(tokens, positions, rows, last)
        if from_zero:
            return self.model.forward_slow(tokens, positions, tokens.shape[-1], row=rows, last=last)
        return self.model.forward_slow(tokens, positions, live, key_pos=self.model.positions[:live], row=rows, last=last)

    def _prefill_batch(self, group: list[tuple[_Request, Tensor, int]], pending: list) -> None:
        """One prefill for several prompts (each from its own start position, in its own slot,
        padded at the end), then their first frames in one replay."""
        model, dev = self.model, self.device
        requests = [r for r, _, _ in group]
        logits, hidden = self._admission(*self._admission_inputs(group))
        logits, hidden = logits[: len(group)], hidden[: len(group)]
        rows = to_device(torch.tensor([r.slot for r in requests]), dev)
        # index_fill_, not `history[rows] = 0`: that assignment waited for the GPU's queued work
        # (5.3-5.5 ms median of the decode loop's time per admission on an H100; sixteenth pass).
        self.history.index_fill_(0, rows, 0)
        temperature, top_p, penalty = self.sampling[:, rows]
        if self.keyed_noise:
            keys = to_device(torch.tensor([self._next_noise_key(r) for r in requests]), dev)
            noise = exponential_noise(keys, torch.empty(len(requests), self.noise.shape[1], device=dev))
        else:
            noise = torch.stack([torch.empty(self.noise.shape[1], device=dev).exponential_(1, generator=r.generator)
                                 for r in requests])
        if self._step is None:
            frames = sample_frame(model, logits, hidden, None, noise, temperature, top_p, penalty)
        else:
            frames = self._step.first_frame(logits, hidden, noise, temperature, top_p, penalty).clone()
        self.current[rows] = frames
        copy = HostCopy(frames)
        for i, request in enumerate(requests):
            pending.append((request, request.chunk, 0, i, copy))

    def _decode_step(self):
        """Queue one frame for every request that still wants one; returns what `_check` needs."""
        rows = [r for r in self._active if not r.finished_chunk and r.computed < r.max_new and not r.ticket.cancelled]
        if not rows:
            return None
        n = len(self._active)
        batch = next(b for b in self.batch_sizes if b >= n)
        pos, index, keys = [0] * batch, [0] * batch, [0] * batch
        for r in rows:
            pos[r.slot] = r.length + r.computed - 1  # where the last frame goes
            index[r.slot] = r.computed - 1  # which frame of the chunk it is
            if self.keyed_noise:
                keys[r.slot] = self._next_noise_key(r)
            else:
                self.noise[r.slot].exponential_(1, generator=r.generator)
        live = max(pos) + 1
        key_pos = self.model.positions[: attention_bucket(self.max_seq_len, live)]
        pos_index = to_device(torch.tensor([pos, index, keys]), self.device)
        input_pos, frame_index = pos_index[0], pos_index[1]
        if self.keyed_noise:
            exponential_noise(pos_index[2], self.noise[:batch])
        start = (frame_index - PENALTY_WINDOW).clamp(min=0)
        columns = (start[:, None] + self.window_offsets)[:, None, :].expand(batch, self.rows, PENALTY_WINDOW)
        window = self.history[:batch].gather(2, columns)
        temperature, top_p, penalty = self.sampling[:, :batch]
        args = (self.model, self.current[:batch], input_pos, window, self.noise[:batch], temperature, top_p, penalty)
        out = decode_frame(*args, key_pos=key_pos) if self._step is None else self._step(*args, key_pos=key_pos)
        self.history[:batch].scatter_(2, frame_index.view(batch, 1, 1).expand(batch, self.rows, 1), out[:, :, None])
        self.current[:batch] = out
        self.steps += 1
        copy = HostCopy(out)
        for r in rows:
            r.computed += 1
        return [(r, r.chunk, r.computed - 1, r.slot, copy) for r in rows]

    @staticmethod
    def _next_noise_key(request: _Request) -> int:
        """The key of the request's next frame of noise (counting it drawn)."""
        request.draws += 1
        return noise_key(request.generator.initial_seed(), request.draws - 1)

    def _check(self, pending: list, step) -> list:
        """Stop checks and delivery for frames queued earlier (while `step` runs on the GPU)."""
        for request, chunk, index, row, copy in pending:
            if request.chunk != chunk or request.finished_chunk or request.slot < 0:
                continue  # the frame queued after its chunk's last one
            if request.ticket.cancelled:
                self._retire(request)
                continue
            frame = copy.get()[row].numpy()
            if int(frame[0]) == self.model.im_end_id:
                self._finish_chunk(request)
                continue
            if "first_frame" not in request.ticket.timings:
                request.ticket.timings["first_frame"] = time.perf_counter() - request.ticket.submitted
            request.codes.append(frame[1:].copy())
            self._decoded.append((request.ticket, request.codes[-1]))
            if index + 1 >= request.max_new:
                self._finish_chunk(request)
        self._hand_over()
        for request in [r for r in self._active if r.ticket.cancelled]:
            self._retire(request)
        return step or []

    def _finish_chunk(self, request: _Request) -> None:
        request.finished_chunk = True
        text = request.chunks[request.chunk]
        request.previous = [(text, torch.from_numpy(np.stack(request.codes, axis=1)))] if request.codes else []
        request.spoken.extend(request.codes)
        if request.chunk + 1 >= len(request.chunks):
            self._complete(request)

    def _complete(self, request: _Request) -> None:
        ticket = request.ticket
        now = time.perf_counter()
        ticket.timings["generate"] = now - ticket.submitted - ticket.timings.get("queue", 0.0)
        self._hand_over()  # its last frames before its end
        self._codec.finish(ticket, request.spoken)
        self._retire(request)

    def _hand_over(self) -> None:
        """Frames checked since the last hand-over go to the codec: once per step, not once per request."""
        if self._decoded:
            self._codec.frames(self._decoded)
            self._decoded = []

    def _fail(self, request: _Request, exc: Exception) -> None:
        request.ticket.emit("error", exc)
        self._retire(request)

    def _retire(self, request: _Request) -> None:
        """Free the request's slot; the last active request moves into it."""
        if request.slot < 0:
            return
        slot, last = request.slot, self._active[-1]
        request.slot, request.finished_chunk = -1, True
        self._active.pop()
        if last is not request:
            self._move(last, slot)
            self._active[slot] = last
        if request.ticket.cancelled:
            self._codec.cancel(request.ticket)
        with self._lock:
            self._lock.notify_all()

    def _move(self, request: _Request, slot: int) -> None:
        src = request.slot
        live = request.length + request.computed
        copy_cache_rows([block.attention.kv_cache for block in self.model.layers], slot, src, live)
        self.history[slot] = self.history[src]
        self.current[slot] = self.current[src]
        self.sampling[:, slot] = self.sampling[:, src]
        request.slot = slot


# A piece of a stream with more than SPARE_S seconds of audio unplayed may wait up to HOLD_S for
# others of its length (CodecWorker._held).
HOLD_S, SPARE_S = 0.1, 0.3

# Padded prompt tokens prefilled together: 32 short requests in one prefill, a few long ones.
PREFILL_TOKENS = 4096


def _prefill_groups(ready: list, padded: Callable[[int, int], tuple[int, int]] = lambda b, w: (b, w)) -> list[list]:
    """Consecutive runs of (request, prompt, start), shortest rest first, whose size padded
    by `padded` (batch, width) stays within PREFILL_TOKENS; prompts from position 0 (which
    captured admissions take) apart from those after a reused prefix."""
    groups, group = [], []
    for item in ready:
        width = item[1].shape[1] - item[2]
        batch, width = padded(len(group) + 1, width)
        if group and (batch * width > PREFILL_TOKENS or (item[2] > 0) != (group[0][2] > 0)):
            groups.append(group)
            group = []
        group.append(item)
    return groups + [group] if group else groups


class CodecWorker:
    """Codes to audio on a thread (and CUDA stream) of its own, piece by piece as frames
    arrive (`StreamingCodec`): streamed requests get each piece, the others one
    concatenation at the end. Before each batch everything queued is taken in; a batch is
    ready pieces of one scheduled length, the shortest (one piece per request, since a
    request's next piece needs the state its last one left)."""

    def __init__(self, engine: Engine, first_piece: int, largest_piece: int, precision: str = "auto"):
        self.engine = engine
        # auto: StreamingCodec's defaults (on a GPU, the back in float16 and TF32 fronts);
        # float32: the codec's own dtype throughout.
        if precision not in ("auto", "float32"):
            raise ValueError(f"codec precision {precision!r}: choose auto or float32")
        exact = {"back_dtype": engine.codec._param.dtype, "front_tf32": False} if precision == "float32" else {}
        self.codec = StreamingCodec(engine.codec, first_piece, largest_piece, **exact)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Audio] = {}  # id(ticket) -> its codec state, frames and audio so far
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the codec thread, if it failed
        self._cuda = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        # Pieces of streams with audio to spare wait up to `hold_s` for more of their length, so
        # the codec decodes fewer, larger batches beside the decode loop (0: never wait).
        self.hold_s, self.spare_s = HOLD_S, SPARE_S

    def capture(self, pieces: int) -> None:
        with self._on_stream():
            self.codec.capture(pieces)

    def _on_stream(self):
        return torch.cuda.stream(self._cuda) if self._cuda is not None else contextlib.nullcontext()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fish-sm-codec", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    # Each queue item is a list of (kind, ticket, codes): a step's frames travel together.
    def frames(self, frames: list[tuple[Ticket, np.ndarray]]) -> None:
        self._queue.put([("frame", ticket, codes) for ticket, codes in frames])

    def finish(self, ticket: Ticket, codes: list[np.ndarray]) -> None:
        self._queue.put([("finish", ticket, codes)])

    def cancel(self, ticket: Ticket) -> None:
        self._queue.put([("cancel", ticket, None)])

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def _run(self) -> None:
        """The codec thread; an error it cannot pin on a batch stops it (and, through
        `alive()`, the engine), failing the requests whose audio it held."""
        try:
            self._serve()
        except BaseException as exc:  # logged here; the thread then ends quietly
            logger.exception("the codec worker failed; it decodes no more audio")
            self.failure = exc
            error = EngineStopped(f"the codec worker stopped after an internal error ({type(exc).__name__})")
            for entry in list(self._streams.values()):
                entry.ticket.emit("error", error)
            self._streams.clear()

    def _serve(self) -> None:
        with torch.inference_mode(), self._on_stream():
            running = True
            while running:
                try:
                    items = [self._queue.get(timeout=self._next_due())]
                except queue.Empty:  # a held piece is due
                    items = []
                running = None not in items
                try:
                    self._take_all(items)
                    # One batch at a time, taking in what arrived meanwhile before choosing the
                    # next: a request's first piece waits behind one batch, not a whole round.
                    while self._decode_next():
                        self._summarise_finished()
                        items = self._drain()
                        running = running and None not in items
                        self._take_all(items)
                    self._summarise_finished()
                except Exception as exc:  # never a dead codec thread: whoever it held gets the error
                    logger.exception("codec worker failed")
                    for entry in self._streams.values():
                        entry.ticket.emit("error", exc)
                    self._streams.clear()

    def _drain(self) -> list:
        items = []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._queue.get_nowait())
        return items

    def _take_all(self, items: list) -> None:
        for batch in items:
            for kind, ticket, codes in batch or ():  # (None: the stop sentinel)
                self._take(kind, ticket, codes)

    def _take(self, kind: str, ticket: Ticket, codes) -> None:
        key = id(ticket)
        if kind == "cancel" or ticket.cancelled:  # (frames may be handed over just before a cancel)
            self._streams.pop(key, None)
            return
        entry = self._streams.setdefault(key, _Audio(ticket))
        if kind == "frame":
            entry.frames.append(codes)
        else:
            entry.finished, entry.all_codes = time.perf_counter(), codes

    def _decode_next(self) -> bool:
        """Decode one batch of ready pieces, the shortest ones (a request's first pieces go
        before the long pieces of requests already playing), and deliver it; False when no
        piece is due. A group of pieces waits (`_held`) while it is short of a full batch and
        every stream in it has audio to spare."""
        ready: dict[int, list[_Audio]] = {}
        now = time.perf_counter()
        for entry in self._streams.values():
            n = self.codec.next_frames(entry.stream)
            if len(entry.frames) >= n or (entry.finished and entry.frames):
                # By scheduled length, what a piece costs: a last, shorter piece is padded to it.
                # (Keyed by its own length, the last pieces of a burst of streams ending together
                # made one group of padded full pieces, and first pieces ready meanwhile waited
                # for all of it.)
                ready.setdefault(n, []).append(entry)
                entry.ready_since = entry.ready_since or now
        due = [n for n, entries in ready.items() if not self._held(n, entries, now)]
        if not due:
            return False
        n = min(due)
        group = [(entry, entry.frames[:n]) for entry in ready[n][: self.codec.rows_for(n)]]
        for entry, _ in group:
            del entry.frames[:n]
            entry.ready_since = 0.0
        for (entry, _), samples in zip(group, self._decode_group(group)):
            if samples is not None:
                self._deliver(entry, samples)
        return True

    def _held(self, n: int, entries: list["_Audio"], now: float) -> bool:
        """Whether a group of ready pieces of length `n` waits: fewer than a batch, none held
        `hold_s` yet, and every one of a stream that has played less than it was given by more
        than `spare_s` (so a request's first pieces and its last, which the client waits for,
        never wait; nor a request whose whole audio is wanted at its end)."""
        if self.hold_s <= 0 or len(entries) >= self.codec.rows_for(n):
            return False
        return all(e.ticket.job.stream and not e.finished and now < e.ready_since + self.hold_s
                   and e.spare(now) > self.spare_s for e in entries)

    def _next_due(self) -> float | None:
        """Seconds until a held piece is due (None: nothing is held)."""
        now = time.perf_counter()
        held = [e for e in self._streams.values() if e.ready_since]
        if not held:
            return None
        return max(0.0, min(min(e.ready_since + self.hold_s, now + e.spare(now) - self.spare_s) for e in held) - now)

    def _summarise_finished(self) -> None:
        for key, entry in list(self._streams.items()):
            if entry.finished and not entry.frames:
                del self._streams[key]
                self._summarise(entry)

    def _decode_group(self, group: list[tuple["_Audio", list[np.ndarray]]]) -> list[np.ndarray | None]:
        try:
            return self._pieces(group)
        except Exception:  # find the one that fails: each alone (their states are as they were)
            logger.exception("codec failed on a batch of %d pieces; retrying them one by one", len(group))
        audio = []
        for entry, frames in group:
            try:
                audio += self._pieces([(entry, frames)])
            except Exception as exc:
                self._streams.pop(id(entry.ticket), None)
                entry.ticket.emit("error", exc)
                audio.append(None)
        return audio

    def _pieces(self, ready: list[tuple["_Audio", list[np.ndarray]]]) -> list[np.ndarray]:
        dev = self.engine.device
        # Host copies through pinned memory (`to_device`, `HostCopy`): a pageable `.cpu()` here
        # waited for the whole batch inside the driver, and the decode loop's CUDA calls (its
        # event records) waited with it, ~30 ms a large batch (thirteenth pass, decode_stalls.py).
        pieces = [(entry.stream, to_device(torch.from_numpy(np.stack(frames, axis=1))[None], dev)) for entry, frames in ready]
        saved = [entry.stream.snapshot() for entry, _ in ready]
        try:
            audio = self.codec.push_many(pieces)
        except Exception:
            for (entry, _), stream in zip(ready, saved):  # as they were, for a retry
                entry.stream = stream
            raise
        copies = [HostCopy(a[0].float()) for a in audio]
        return [copy.get().numpy().copy() for copy in copies]  # (the pinned blocks back at once)

    def _deliver(self, entry: "_Audio", samples: np.ndarray) -> None:
        ticket = entry.ticket
        if ticket.job.stream:
            if "first_audio" not in ticket.timings:
                ticket.timings["first_audio"] = time.perf_counter() - ticket.submitted
                entry.playing_since = time.perf_counter()
            entry.given_s += len(samples) / self.engine.sample_rate
            ticket.emit("audio", samples)
        else:
            entry.audio.append(samples)

    def _summarise(self, entry: "_Audio") -> None:
        ticket, codes = entry.ticket, entry.all_codes
        if not ticket.job.stream:
            ticket.emit("audio", np.concatenate(entry.audio) if entry.audio else np.zeros(0, np.float32))
        ticket.timings["decode"] = time.perf_counter() - entry.finished
        ticket.timings["total"] = time.perf_counter() - ticket.submitted
        n = len(codes)
        seconds = n * self.engine.frame_length / self.engine.sample_rate
        stacked = torch.from_numpy(np.stack(codes, axis=1)) if codes else torch.zeros(self.engine.config.num_codebooks, 0, dtype=torch.long)
        ticket.emit("done", Synthesis(audio=None, sample_rate=self.engine.sample_rate, frames=n, seconds=seconds,
                                      rtf=ticket.timings["total"] / seconds if seconds else float("inf"),
                                      timings=dict(ticket.timings), codes=stacked))


@dataclass
class _Slot:
    """What `_admission_inputs` reads of a request: a stand-in for start-up checks."""

    slot: int
    length: int


@dataclass
class _Audio:
    """A request's place in the codec: its decoder state, frames not yet decoded, audio so far."""

    ticket: Ticket
    stream: CodecStream = field(default_factory=CodecStream)
    frames: list = field(default_factory=list)
    audio: list = field(default_factory=list)
    finished: float = 0.0  # when its last frame was handed over (0: still decoding)
    all_codes: list = field(default_factory=list)
    ready_since: float = 0.0  # when its next piece's frames were all there (0: not yet)
    playing_since: float = 0.0  # its first audio (streamed)
    given_s: float = 0.0  # audio streamed so far, in seconds

    def spare(self, now: float) -> float:
        """Seconds of streamed audio a listener who began at the first piece has not reached yet."""
        return self.given_s - (now - self.playing_since) if self.playing_since else 0.0
