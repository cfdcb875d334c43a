"""The codec worker's hold (eighteenth pass), A/B in one process: pieces of streams with
more than `spare_s` of audio unplayed waiting up to `hold_s` for a batch of their length,
against decoding whatever is ready at once. 32 streams at once and a closed loop of 32
clients x 6 requests, the settings in turns (the engine started afresh for each, as
`settings_in_turns` runs it; as measured, one start for all). Not part of the package.

    cd docs/experiments && python3 codec_hold_ab.py CHECKPOINT_DIR [ROUNDS] [HOLD_S,...]    # writes $OUT/codec_hold_ab.json
"""
import json, os, sys

from experiment_tools import LOOP_SUMMARY, compiled_batcher, settings_in_turns

batcher, out = compiled_batcher(sys.argv[1], 32)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
holds = [float(h) for h in (sys.argv[3] if len(sys.argv) > 3 else "0,0.1").split(",")]


def hold(seconds: float):
    def apply():
        batcher._codec.hold_s = seconds
    return apply


out["levels"] = settings_in_turns(batcher, {f"hold {h:g} s": hold(h) for h in holds}, [32], rounds, "setting",
                                  loops=(1, 6), summary=LOOP_SUMMARY)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "codec_hold_ab.json"), "w"), indent=1)
