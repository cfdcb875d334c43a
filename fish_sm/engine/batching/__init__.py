"""Continuous batching: many requests share every decode step of one model.

One thread runs the model. Between two decode steps it admits waiting requests into
free KV-cache slots (their prompts prefilled together, padded, and their first frames
sampled in one replay) and retires the ones that finished; each step then decodes one
frame for every admitted request at once, so the weights read for a frame serve the
whole batch. Requests keep everything that makes them theirs: sampling parameters, seed
(their own random stream, drawn the same whatever the batch, so a request gives the same
codes batched or alone in float32; bf16 GPU kernels of other batch sizes round
differently), stop token, length, long text spoken chunk by chunk. A second thread turns
codes into audio on its own CUDA stream, overlapping the decoding: pieces as frames
arrive (streaming) or the whole utterance at the end.

KV memory is allotted in slots, one sequence of `max_seq_len` each, as many as fit the free
GPU memory. A request keeps its slot from admission to its end; each step names the slots it
decodes, chosen for the listeners (a stream with enough audio buffered yields its turn), and
runs the smallest captured batch size that holds them, its attention reading up to the
longest one's bucketed length. A waiting queue of bounded length holds the rest; beyond it
`submit` refuses at once (`Overloaded`).

  request.py       Job, Ticket and its events, Session (text arriving while it speaks), Overloaded, EngineStopped
  scheduler.py     Scheduler: the waiting queue, slots, chunks of text, stop checks (no tensors)
  runner.py        ModelRunner: KV cache and step inputs, memory sizing, captured graphs, prefills, the decode step
  prefix_cache.py  PrefixCache: reference voices' prompt prefixes, prefilled once
  codec_worker.py  CodecWorker: the codec thread, codes to audio in batched pieces
  engine.py        BatchEngine: the public face, the engine thread's schedule -> execute -> update
"""

from fish_sm.engine.batching.codec_worker import CodecWorker
from fish_sm.engine.batching.engine import BatchEngine
from fish_sm.engine.batching.prefix_cache import PrefixCache
from fish_sm.engine.batching.request import EngineStopped, Event, Job, Overloaded, Session, Ticket
from fish_sm.engine.batching.runner import PREFILL_TOKENS
from fish_sm.engine.generate import batch_sizes

__all__ = ["BatchEngine", "CodecWorker", "EngineStopped", "Event", "Job", "Overloaded", "PREFILL_TOKENS",
           "PrefixCache", "Session", "Ticket", "batch_sizes"]
