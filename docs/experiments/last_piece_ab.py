"""A stream's last piece through the codec's back, A/B: over the shortest scheduled length
that holds it (as shipped, `StreamingCodec.back_frames`) against over its whole scheduled
length (before; for the benchmark's 200-frame requests, whose last piece is scheduled at the
largest length, 64 frames). One batching engine, the variants in turns. Not part of the
package.

    python docs/experiments/last_piece_ab.py CHECKPOINT_DIR [STREAMS=1,16,32,64] [ROUNDS=2]
    # one JSON line per level, $OUT/last_piece_ab.json
"""
import functools, json, os, sys

from fish_sm.engine.codec_stream import StreamingCodec
from fish_sm.engine.engine import freeze_start_up_objects
from experiment_tools import compiled_batcher, settings_in_turns

checkpoint = sys.argv[1]
streams = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,16,32,64").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
batcher, out = compiled_batcher(checkpoint, max(streams))
freeze_start_up_objects()
shortest = StreamingCodec.back_frames
variants = {"shortest": shortest, "scheduled": lambda self, n: self.largest}
out["levels"] = settings_in_turns(batcher, {name: functools.partial(setattr, StreamingCodec, "back_frames", f)
                                            for name, f in variants.items()}, streams, rounds, "last_piece")
StreamingCodec.back_frames = shortest
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "last_piece_ab.json"), "w"), indent=1)
