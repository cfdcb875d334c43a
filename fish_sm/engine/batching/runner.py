"""The batching engine's model side: the KV cache in slots and everything else a slot holds
on the GPU (last frame, history, sampling parameters), memory sizing, the captured graphs,
prefills and the decode step. It does what the scheduler decided, for the requests it is
handed: a step names its requests' slots (any of them, in any order), so a request keeps its
slot from admission to its end and nothing is copied when others come and go.

The cache has one row more than there are slots: a scratch row that padded step rows and
graph captures write into, so graphs can be captured while requests hold every slot. At
start only the small batch sizes are captured (`capture`); the larger ones follow between
steps (`capture_next`), steps larger than the largest captured one run as several replays.

The prompt part made of reference voices is the same for every request that uses them:
its KV cache is computed once and copied into a slot (`PrefixCache`), so admitting a
request with a packaged voice prefills only its own text."""

from __future__ import annotations

import bisect
import collections
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import Tensor

from fish_sm import kernels
from fish_sm.engine.generate import (FIRST_INTS, STEP_FLOATS, STEP_INTS, GraphedStep, HostCopy, HostStaging,
                                     SlotState, admission_shape, admission_shapes, attention_bucket, batch_sizes,
                                     decode_slots, first_slots, frame_budget, length_buckets, noise_size, step_layout,
                                     to_device)
from fish_sm.engine.prompt import build_prompt, chunk_prompt, prompt_prefix
from fish_sm.engine.sampling import PENALTY_WINDOW, request_generator
from fish_sm.errors import FishSMError
from fish_sm.model.dual_ar import cache_rows
from fish_sm.engine.batching.prefix_cache import PrefixCache
from fish_sm.engine.batching.scheduler import Request, StepRows
from fish_sm.engine.batching.slots import SlotTable

if TYPE_CHECKING:  # (the engine builds batching engines over itself: no import at run time)
    from fish_sm.engine.engine import Engine

logger = logging.getLogger("fish_sm.batching")

# Padded prompt tokens prefilled together: 32 short requests in one prefill, a few long ones.
PREFILL_TOKENS = 4096
# Batch sizes captured before serving (4: every compiled variant of the step, one row, two and
# any number, is traced by then); larger ones are captured between steps once serving.
START_BATCH = 4
# Most slots when FISH_SM_MAX_BATCH is 0 (as many as the memory holds).
MOST_SLOTS = 1024


def host_frames(frames: Tensor) -> Callable[[], np.ndarray]:
    """Sampled frames [rows, 1 + C] on their way to the host in one copy (`HostCopy`): the
    returned function waits for them."""
    copy = HostCopy(frames)
    return lambda: copy.get().numpy()


class ModelRunner:
    """The model's work over slots of an `Engine`'s model (which it takes over: the KV cache
    is re-made with one row per slot)."""

    def __init__(self, engine: Engine, max_batch: int, memory_fraction: float, prefix_cache: int,
                 codec_bytes: Callable[[], int], codec_slot_bytes: int = 0):
        self.engine, self.model = engine, engine.model
        self.device = engine.device
        model, c = self.model, engine.config
        self.rows = 1 + c.num_codebooks
        self.max_seq_len = model.max_seq_len
        self.slots = self._fit_slots(max_batch, memory_fraction, prefix_cache, codec_bytes, codec_slot_bytes)
        self.scratch = self.slots  # the cache row that padding and captures write into
        model.setup_caches(self.slots + 1, self.max_seq_len)
        self.batch_sizes = batch_sizes(self.slots)
        dev = self.device
        cache_rows = self.slots + 1
        self.current = torch.zeros(cache_rows, self.rows, dtype=torch.long, device=dev)  # each slot's last frame
        self.history = torch.zeros(cache_rows, self.rows, self.max_seq_len + PENALTY_WINDOW, dtype=torch.long, device=dev)
        # A step's or an admission's inputs go to the GPU in one copy (the largest: a prefill's
        # padded tokens with their positions, rows and last positions).
        self.staging = HostStaging(dev, PREFILL_TOKENS * (self.rows + 1) * 8 + 4 * (self.slots + 1) * 8 + 256)
        # How admissions ran: "captured", "compiled" (a shape no graph has), "continued" (after a prefix).
        self.prefills: collections.Counter = collections.Counter()
        self.noise = torch.ones(self.slots, noise_size(model), device=dev)  # per row of a step
        # On CUDA a step's noise is one kernel keyed by each request's seed and frame number
        # (`kernels.exponential_noise`); on the CPU each request's generator draws it, frame
        # after frame, so that a request gives the same codes batched or alone.
        self.keyed_noise = kernels.sampling_usable(dev)
        self.prefixes = PrefixCache(prefix_cache)
        self.adapters = engine.adapters  # LoRA adapters (each request's slot of them), or None
        self.state = SlotState(self.current, self.history, self.noise, self.keyed_noise,
                               None if self.adapters is None else self.adapters.slots.set_rows)
        # The scheduler's per-slot state and requests by slot (`bind`): what a step's inputs are built from.
        self.table: SlotTable | None = None
        self.requests: list[Request | None] = []
        self.captured: GraphedStep | None = None  # the decode steps, first frames and admissions (CUDA, `capture`)
        self.ready_sizes: list[int] = []  # batch sizes whose decode steps are captured for every bucket
        self._to_capture: list[tuple] = []  # what `capture_next` captures, in order
        self._queued: set[tuple] = set()  # continuations queued for capture (`_admission`)
        # The batch size the last decode wanted and found not captured, where the captured ones
        # fit it badly (`_want`): captured next, between two steps.
        self.wanted: int | None = None
        self.steps = 0
        self.launch_s = 0.0  # host seconds queuing decode steps' GPU work (a graph's replay, or the eager step's ops)

    def _fit_slots(self, max_batch: int, memory_fraction: float, prefix_cache: int,
                   codec_bytes: Callable[[], int], codec_slot_bytes: int) -> int:
        """Admission control: as many sequences as the free GPU memory holds (after room for
        the prefix cache, the captured graphs and the codec's largest batch, `codec_bytes()`;
        each slot with the codec's state for its streams, `codec_slot_bytes`), at most `max_batch`."""
        if self.device.type != "cuda":
            return max_batch if max_batch > 0 else 8
        max_batch = max_batch if max_batch > 0 else MOST_SLOTS
        c, dtype = self.engine.config, self.engine.model.dtype
        per_token = 2 * c.n_layer * c.n_local_heads * c.head_dim * torch.finfo(dtype).bits // 8
        per_slot = per_token * self.max_seq_len + self.rows * (self.max_seq_len + PENALTY_WINDOW) * 8 + codec_slot_bytes
        codec = codec_bytes()
        torch.cuda.empty_cache()  # the measurement's blocks, cached, would count as used below and in `codec` too
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = (1 - memory_fraction) * total + prefix_cache * per_token * self.max_seq_len // 4 + (2 << 30) + codec
        fit = int((free - reserve) // per_slot) - 1  # and the scratch row
        if fit < 1:
            raise FishSMError(f"no room for a single {self.max_seq_len}-token KV cache on {self.device} "
                              f"({free / 2**30:.1f} GiB free); lower FISH_SM_MAX_SEQ_LEN")
        slots = min(max_batch, fit)
        logger.info("batching: %d slots of %d tokens (%.2f GiB each; %d asked for, %d fit) in %.1f GiB free, "
                    "keeping %.1f GiB for graphs, prefixes and the codec (%.1f GiB)", slots, self.max_seq_len,
                    per_slot / 2**30, max_batch, fit, free / 2**30, reserve / 2**30, codec / 2**30)
        return slots

    # -- capture (CUDA) -----------------------------------------------------------------

    def capture(self, start_batch: int = START_BATCH) -> float:
        """Capture the decode step for every batch size up to `start_batch` and every attention
        bucket, their first frames and admissions; the larger sizes are left to
        `capture_next`. Returns the seconds from the first capture."""
        step = GraphedStep(self.model, self.state, scratch_row=self.scratch, max_batch=self.slots,
                           adapters=None if self.adapters is None else self.adapters.slots)
        t0 = time.perf_counter()
        now = [b for b in self.batch_sizes if b <= start_batch]
        step.capture_all(now)
        self.ready_sizes = list(now)
        self._compile_admissions()
        later = []
        for batch, width in admission_shapes(self.slots, self.max_seq_len, PREFILL_TOKENS):
            if batch <= start_batch:
                step.capture_admission(batch, width)
            else:
                later.append(("admission", batch, width))
        self.captured = step
        self._check_admissions()
        # Between steps: each larger batch size's decode steps (all buckets), then its first frames,
        # then the larger admissions.
        for batch in self.batch_sizes:
            if batch > start_batch:
                buckets = length_buckets(self.max_seq_len)
                self._to_capture += [("decode", batch, bucket, i == 0) for i, bucket in enumerate(buckets)]
                self._to_capture.append(("first", batch))
        self._to_capture += later
        step.capture_error_mode = "thread_local"  # from now on the codec's thread uses the GPU beside captures
        return time.perf_counter() - t0

    @property
    def capturing(self) -> bool:
        """Graphs are still to be captured between steps."""
        return bool(self._to_capture)

    def capture_due(self, idle: bool) -> bool:
        """Whether to capture the next graph now, between two steps: when the engine is `idle`,
        when the load wants a batch size the captured ones fit badly (`wanted`), or for a
        prefix's continuation, first seen: a capture holds up every stream for its duration
        (0.05-0.7 s), which only a use for the graph pays for."""
        return bool(self._to_capture) and (idle or self.wanted is not None or self._to_capture[0][0] == "continued")

    def _want(self, rows: int) -> None:
        """After a decode of `rows` rows: the batch size that holds them is `wanted` when it is
        still to be captured and the captured sizes fit the load badly: it took several steps
        of the largest, or one of more than twice the rows' size. A burst right after start-up
        then waits for the captures of the one size it needs, not of every size below it."""
        size = next(b for b in self.batch_sizes if b >= rows)
        used = next((b for b in self.ready_sizes if b >= rows), None)
        pending = any(kind in ("decode", "first") and args[0] == size for kind, *args in self._to_capture)
        self.wanted = size if pending and (used is None or used > 2 * size) else None

    def _next_capture(self) -> int:
        """Where in `_to_capture` the next capture is: a continuation first seen, else the
        wanted batch size's graphs (its decode steps, then its first frames), else the first."""
        if self.wanted is None or self._to_capture[0][0] == "continued":
            return 0
        return next((i for i, (kind, *args) in enumerate(self._to_capture)
                     if kind in ("decode", "first") and args[0] == self.wanted), 0)

    @torch.inference_mode()
    def capture_next(self) -> None:
        """Capture the next graph left by `capture` (into the scratch row: no request's rows change)."""
        kind, *args = self._to_capture.pop(self._next_capture())
        step = self.captured
        if kind == "decode":
            batch, bucket, warm_up = args
            step.capture(batch, bucket, warm_up)
        elif kind == "first":
            step.capture_first(*args)
            bisect.insort(self.ready_sizes, args[0])  # its decode steps came just before
            if self.wanted == args[0]:
                self.wanted = None
        elif kind == "continued":
            step.capture_continuation(*args)
            return
        else:
            step.capture_admission(*args)
        if not self._to_capture:
            logger.info("batching: every graph captured: %d decode, %d admission", len(step.graphs),
                        len(step.admissions))

    @torch.inference_mode()
    def _check_admissions(self) -> None:
        """Three prompts through a captured admission and through the compiled layers must
        agree (bf16 tolerance), or captured admissions are turned off, logged, rather than
        serve wrong frames."""
        texts = ("One.", "A second, somewhat longer prompt.", "The third.")[: min(3, self.slots)]
        _, captured, compiled = self.admissions_both_ways(
            [build_prompt(self.engine.tokenizer, self.engine.config.num_codebooks, [], t) for t in texts])
        if not torch.allclose(captured, compiled, atol=0.5, rtol=0):
            logger.warning("batching: captured admissions disagree with the compiled layers (largest logit "
                           "difference %s); admitting through the compiled layers", (captured - compiled).abs().max().item())
            self.captured.admissions.clear()

    @torch.inference_mode()
    def admissions_both_ways(self, prompts: list[Tensor]) -> tuple[list[int], Tensor, Tensor]:
        """Prompts from position 0 admitted into slots 0.. (before serving), through a
        captured admission and through the compiled layers: the padded [batch, width] and
        each way's logits [prompts, vocab] in float32."""
        inputs = self._admission_inputs([(_Slot(i), p, 0) for i, p in enumerate(prompts)])
        captured, compiled = (self._admission(*inputs, captured=c)[0][: len(prompts)].float().clone() for c in (True, False))
        return list(inputs[0].shape[::2]), captured, compiled

    @torch.inference_mode()  # as the decode loop runs them
    def _compile_admissions(self) -> None:
        """Compile the admissions' prefill (installed by `kernels.install(model, kernels.BATCHING)`) for one prompt and for several,
        the two cases the compiled code tells apart, before a request waits on it. It writes
        into slots that are free."""
        width = 16
        for batch in sorted({1, min(2, self.slots)}):  # host arrays, staged as a request's are
            tokens = np.zeros((batch, self.rows, width), np.int64)
            positions = np.broadcast_to(np.arange(width), (batch, width))
            self._admission(tokens, positions, np.arange(batch), np.full(batch, width - 1), width, from_zero=True,
                            captured=False)

    def bind(self, table: SlotTable, requests: list[Request | None]) -> None:
        self.table, self.requests = table, requests

    # -- admissions ---------------------------------------------------------------------

    def new_generator(self, seed: int | None) -> torch.Generator:
        """A request's random stream (raises for a seed it cannot take)."""
        return request_generator(self.device, seed)

    def prepare_chunk(self, request: Request) -> tuple[Tensor, int, int]:
        """The prompt of the request's current chunk, how many frames may follow it, and how
        many of its positions a reused prefix has put into the request's slot. Raises
        `InputError` (a prompt too long) or CUDA's out-of-memory error: the request's own."""
        previous = [(text, torch.from_numpy(codes)) for text, codes in request.previous]
        prompt = chunk_prompt(self.engine.tokenizer, self.engine.config.num_codebooks, self.max_seq_len,
                              self._references(request), previous, request.chunks[request.chunk])
        max_new = frame_budget(prompt.shape[1], self.max_seq_len, request.params.max_new_tokens)
        start = self._reuse_prefix(request, prompt)
        return prompt, max_new, start

    def _references(self, request: Request) -> list[tuple[str, Tensor]]:
        return [(r.text, r.codes) for r in request.ticket.job.references]

    def _reuse_prefix(self, request: Request, prompt: Tensor) -> int:
        """Put the KV cache of the prompt's reference part into the request's slot (from the
        prefix cache, or computed and kept there); returns how many positions it covers."""
        references = self._references(request)
        if not references:
            return 0
        model, slot = self.model, request.slot
        caches = [block.attention.kv_cache for block in model.layers]
        key = tuple((text, hashlib.sha256(codes.numpy().tobytes()).hexdigest()) for text, codes in references)
        if request.adapter_slot:  # an adapter's prefix is its own (as read: one read afresh may differ)
            key += (self.adapters.version(request.ticket.job.adapter),)
        kv = self.prefixes.get(key)
        if kv is None:
            prefix = prompt_prefix(self.engine.tokenizer, self.engine.config.num_codebooks, references)
            n = prefix.shape[1]
            self._use_adapters([request.adapter_slot])
            model.forward_slow(to_device(prefix, self.device)[None], model.positions[:n], n, row=slot)
            kv = [t.clone() for t in cache_rows(caches, slot, n)]
            self.prefixes.put(key, kv)
        else:
            torch._foreach_copy_(cache_rows(caches, slot, kv[0].shape[1]), kv)
        return kv[0].shape[1]

    def prefill(self, ready: list[tuple[Request, Tensor, int]]
                ) -> tuple[list[StepRows], list[tuple[Request, Exception]]]:
        """Prefill each (request, prompt, start)'s prompt from `start` into its slot and sample
        its first frame: the prompts padded into batches of at most `PREFILL_TOKENS`, each one
        prefill and one first-frame replay. Returns the first frames, and the requests that
        ran out of memory on their own, with the error."""
        steps, failed = [], []
        ready.sort(key=lambda item: (item[2] > 0, item[1].shape[1] - item[2]))  # from position 0 first, shortest first
        groups = _prefill_groups(ready, self._group_shape)
        while groups:
            group = groups.pop(0)
            try:
                steps += self._prefill_batch(group)
            except torch.cuda.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                if len(group) > 1:  # again one at a time, each failing on its own
                    groups[:0] = [[item] for item in group]
                else:
                    failed.append((group[0][0], exc))
        return steps, failed

    def _group_shape(self, batch: int, width: int) -> tuple[int, int]:
        """The shape a group of prompts from position 0 is bounded by: with captured admissions,
        the captured shape it pads to (whether or not captured yet), so that a burst is split
        into groups that captured admissions take, not run as one large shape no graph has."""
        if self.captured is None or not self.captured.admissions:
            return batch, width
        return admission_shape(batch, width, self.slots, self.max_seq_len)

    def _admission_shape(self, batch: int, width: int) -> tuple[int, int]:
        """The (batch, width) prompts from position 0 are padded to: a captured admission's on CUDA."""
        shape = self._group_shape(batch, width)
        return shape if self.captured is not None and shape in self.captured.admissions else (batch, width)

    def _admission_inputs(self, group: list[tuple[Request, Tensor, int]]) -> tuple:
        """Tokens, positions, cache rows and last positions of the prompts' rests (after any
        reused prefix), each padded at its end with its last token (whose keys land after the
        prompt, where decoding overwrites them before a query may see them), host arrays; and
        the slots in use once they are written. Prompts all from position 0 are padded to
        `_admission_shape`, spare rows repeating the first prompt (the same values written
        into its row again)."""
        rests = [prompt[:, start:] for _, prompt, start in group]
        starts = [start for _, _, start in group]
        width = max(rest.shape[1] for rest in rests)
        if not any(starts):
            batch, width = self._admission_shape(len(group), width)
        else:  # after a prefix: the shape a captured continuation has, or will once captured (`_admission`)
            batch, width = self._group_shape(len(group), width)
        rests += rests[:1] * (batch - len(group))
        starts += starts[:1] * (batch - len(group))
        tokens = np.empty((batch, self.rows, width), np.int64)
        for i, rest in enumerate(rests):
            n = rest.shape[1]
            tokens[i, :, :n] = rest.numpy()
            tokens[i, :, n:] = tokens[i, :, n - 1 : n]
        positions = np.minimum(np.array(starts)[:, None] + np.arange(width), self.max_seq_len - 1)
        rows = np.array([r.slot for r, _, _ in group] + [group[0][0].slot] * (batch - len(group)))
        last = np.array([rest.shape[1] - 1 for rest in rests])
        return tokens, positions, rows, last, max(prompt.shape[1] for _, prompt, _ in group), not any(starts)

    def _admission(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, last: np.ndarray, live: int,
                   from_zero: bool, captured: bool = True):
        """The slow transformer over padded prompts (host arrays, `_admission_inputs`): a
        captured admission's replay where there is one (its inputs staged straight into its
        buffer), else the compiled layers (eagerly on CPU); from position 0 causally over
        their own positions, after a reused prefix over the `live` slots in use (on CUDA, as
        many as the attention bucket that holds them). A continuation of a shape no graph has
        yet is captured between steps, for the next prompt of its shape (a voice's prompts
        after its kept prefix are all alike)."""
        shape = (tokens.shape[0], tokens.shape[-1])
        key = (*shape, attention_bucket(self.max_seq_len, live))  # a continuation's graph
        arrays = (tokens, positions, rows, last)
        if captured and self.captured is not None:
            if from_zero and shape in self.captured.admissions:
                self.prefills["captured"] += 1
                return self.captured.admit(self.captured.admissions, shape, self.staging, arrays)
            if not from_zero and key in self.captured.continuations:
                self.prefills["continued", "captured"] += 1
                return self.captured.admit(self.captured.continuations, key, self.staging, arrays)
        tokens, positions, rows, last = self.staging.copy(*arrays)
        if from_zero:
            self.prefills["compiled", *shape] += 1
            return self.model.forward_slow(tokens, positions, tokens.shape[-1], row=rows, last=last)
        if self.captured is None:
            self.prefills["continued"] += 1
            return self.model.forward_slow(tokens, positions, live, key_pos=self.model.positions[:live], row=rows, last=last)
        if captured and self.captured.admissions and shape == self._group_shape(*shape) and key not in self._queued:
            self._queued.add(key)
            self._to_capture.insert(0, ("continued", *key))  # (before any larger batch size: wanted now)
        self.prefills["continued"] += 1
        return self.model.forward_slow(tokens, positions, key[-1], key_pos=self.model.positions[: key[-1]], row=rows,
                                       last=last)

    def _prefill_batch(self, group: list[tuple[Request, Tensor, int]]) -> list[StepRows]:
        """One prefill for several prompts (each from its own start position, in its own slot,
        padded at the end), then their first frames in one replay (`first_slots`)."""
        model = self.model
        requests = [r for r, _, _ in group]
        inputs = self._admission_inputs(group)
        # the spare rows of a padded batch repeat the first prompt, adapter and all
        self._use_adapters([r.adapter_slot for r in requests] + [requests[0].adapter_slot] * (inputs[0].shape[0] - len(group)))
        logits, hidden = self._admission(*inputs)
        n = len(group)
        logits, hidden = logits[:n], hidden[:n]
        slots = np.array([r.slot for r in requests])
        for r in requests:
            self._settle_draws(r)
        sizes = self.captured.first_sizes(n) if self.captured is not None else []
        batch = sizes[0] if sizes else n
        ints, floats = self._row_inputs(slots, batch, FIRST_INTS)  # noise key, cache row
        if sizes:
            self.staging.write(self.captured.first_buffer, [(0, ints), (step_layout(batch, FIRST_INTS)[0], floats)])
            frames = self.captured.first_frame(batch, logits, hidden)[:n]
        else:
            frames = first_slots(model, self.state, *self.staging.copy(ints, floats), logits, hidden)
        return [StepRows(slots, self.table.generation[slots], self.table.chunk[slots], np.zeros(n, np.int64),
                         host_frames(frames))]

    # -- the decode step ----------------------------------------------------------------

    def decode(self, slots: np.ndarray) -> list[StepRows]:
        """Queue one frame for each of these slots' requests: one step of the smallest captured
        batch size that holds them, or several of the largest captured."""
        if not slots.size:
            return []
        most = self.ready_sizes[-1] if self.captured is not None else len(slots)
        if self._to_capture:
            self._want(len(slots))
        steps = [self._decode_rows(slots[start : start + most]) for start in range(0, len(slots), most)]
        self.steps += 1
        return steps

    def _decode_rows(self, slots: np.ndarray) -> StepRows:
        """One replay (or, without graphs, one eager step) for these slots, its inputs built
        from the slot table's arrays and copied to the GPU at once (into the graph's own
        buffer); padding rows name the scratch row."""
        n, t = len(slots), self.table
        batch = n if self.captured is None else next(b for b in self.ready_sizes if b >= n)
        index = t.computed[slots] - 1  # which frame of the chunk it feeds (it samples the next)
        ints, floats = self._row_inputs(slots, batch, STEP_INTS)  # noise key, cache row, position, frame index, adapter
        ints[2, :n] = t.length[slots] + index  # where the last frame goes
        ints[3, :n] = index
        ints[4, :n] = t.adapter[slots]
        bucket = attention_bucket(self.max_seq_len, int(ints[2, :n].max()) + 1)
        if self.captured is None:
            ints, floats = self.staging.copy(ints, floats)
            began = time.perf_counter()
            out = decode_slots(self.model, self.state, ints, floats, self.model.positions[:bucket])
        else:
            self.staging.write(self.captured.step_buffer, [(0, ints), (step_layout(batch)[0], floats)])
            began = time.perf_counter()
            out = self.captured.replay(batch, bucket, adapters=bool(ints[4, :n].any()))
        self.launch_s += time.perf_counter() - began
        return StepRows(slots, t.generation[slots], t.chunk[slots], index + 1, host_frames(out[:n]))

    def _row_inputs(self, slots: np.ndarray, batch: int, n_ints: int) -> tuple[np.ndarray, np.ndarray]:
        """A step's host inputs for these slots padded to `batch` rows: ints [n_ints, batch] with
        each row's noise key and cache row filled (padding rows name the scratch row), floats
        [STEP_FLOATS, batch, 1] its sampling parameters (padding rows 1). Without keyed noise
        each request's generator draws its noise rows now, the same batched or alone."""
        n = len(slots)
        ints = np.zeros((n_ints, batch), np.int64)
        ints[1] = self.scratch
        ints[1, :n] = slots
        floats = np.ones((STEP_FLOATS, batch, 1), np.float32)
        floats[:, :n, 0] = self.table.sampling[:, slots]
        if self.keyed_noise:
            ints[0, :n] = self.table.next_keys(slots)
        else:
            for i, slot in enumerate(slots):
                self.noise[i].exponential_(1, generator=self.requests[slot].generator)
        return ints, floats

    def _use_adapters(self, adapter_slots: list[int]) -> None:
        """The next call's rows use these adapter slots."""
        if self.adapters is not None:
            self.adapters.slots.set_rows(to_device(torch.tensor(adapter_slots), self.device))

    def _settle_draws(self, request: Request) -> None:
        """Draw (and drop) the noise the request's random stream owes (`Request.owed_draws`), so
        that its next chunk draws what it would alone."""
        if self.keyed_noise:
            self.table.draws[request.slot] += request.owed_draws
        else:
            for _ in range(request.owed_draws):
                torch.empty(self.noise.shape[1], device=self.device).exponential_(1, generator=request.generator)
        request.owed_draws = 0


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


@dataclass
class _Slot:
    """What `_admission_inputs` reads of a request: a stand-in for start-up checks."""

    slot: int
