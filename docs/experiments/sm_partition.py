"""The batching engine with the GPU's SMs split between the decode loop and the codec (two
CUDA green contexts over disjoint SMs, made through the driver API). With both on all SMs,
a decode step that meets a large codec batch takes ~33 ms instead of ~3.9 (`decode_stalls.py`):
each of its ~1,100 small kernels waits for codec blocks to retire. A green context of the
codec alone did not help (`codec_green_context.py`): decode kernels still had blocks on
the codec's SMs. Not part of the package.

For each setting, "all" (as shipped) or D (decode on D SMs, the codec on the rest): the
decode graphs and the codec's graphs captured again on the new streams, the decode step
alone (the 32-row graph at its longest bucket, replayed), then 32 and 64 streamed requests
of 200 frames (`batching_level`).

    python docs/experiments/sm_partition.py CHECKPOINT_DIR [SETTINGS=all,66,80,96] [STREAMS=32,64]
    # JSON lines, $OUT/sm_partition.json
"""
import ctypes, json, os, statistics, sys, time

import torch

from experiment_tools import capture_on, compiled_batcher, recapture_codec, settings_in_turns

checkpoint = sys.argv[1]
names = (sys.argv[2] if len(sys.argv) > 2 else "all,66,80,96").split(",")
streams = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "32,64").split(",")]
driver = ctypes.CDLL("libcuda.so.1")
RESOURCE_BYTES = 1024  # room for a CUdevResource in any CUDA version
SM_COUNT_OFFSET = 96  # CUdevResource: type (4 bytes), 92 internal bytes, then the SM resource's smCount


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def split_streams(decode_sms: int) -> tuple:
    """Two streams on disjoint SMs: (decode stream on `decode_sms` SMs, codec stream on the
    rest, SM counts as the driver rounded them)."""
    torch.cuda.init()
    dev = ctypes.c_int()
    _check(driver.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
    whole, group, rest = (ctypes.create_string_buffer(RESOURCE_BYTES) for _ in range(3))
    _check(driver.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # CU_DEV_RESOURCE_TYPE_SM
    groups = ctypes.c_uint(1)
    _check(driver.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0, ctypes.c_uint(decode_sms)),
           "cuDevSmResourceSplitByCount")

    def stream(resource, priority: int):
        desc, ctx, handle = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(driver.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        _check(driver.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")  # DEFAULT_STREAM flag
        _check(driver.cuGreenCtxStreamCreate(ctypes.byref(handle), ctx, 1, priority), "cuGreenCtxStreamCreate")
        return torch.cuda.ExternalStream(handle.value)

    count = lambda r: int.from_bytes(r.raw[SM_COUNT_OFFSET:SM_COUNT_OFFSET + 4], "little")
    return stream(group, -1), stream(rest, 0), (count(group), count(rest), count(whole))


out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
save = lambda: json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sm_partition.json"), "w"), indent=1)
batcher, record = compiled_batcher(checkpoint, max(streams))
out.update(record)
step, worker = batcher._step, batcher._codec
shipped = (batcher.decode_stream, worker._cuda)
retired = []  # replaced graphs stay alive (dropping a whole pool's graphs trips an allocator assert)


def recapture_decode() -> None:
    retired.append((dict(step.graphs), dict(step.admissions)))
    step.pool = torch.cuda.graph_pool_handle()
    for key in list(step.graphs):
        if key[0] == "first":
            step.capture_first(key[1])
        elif key[0] != "prefill":
            step.capture(*key)
    for batch, width in list(step.admissions):
        step.capture_admission(batch, width)


def decode_step_ms(stream, rows: int = 32) -> float:
    """The `rows`-row decode graph at its longest attention bucket, replayed alone on `stream`."""
    bucket = max(b for kind, b in step.graphs if kind == rows)
    graph = step.graphs[(rows, bucket)][0]
    with torch.cuda.stream(stream):
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 20


def apply(name: str) -> None:
    if name.startswith("all"):
        decode, codec = shipped
        if name != names[0]:  # back to the primary context's streams
            batcher.decode_stream, worker._cuda = decode, codec
            capture_on(decode, recapture_decode), capture_on(codec, lambda: recapture_codec(worker, retired))
        out.setdefault("sms", {})[name] = "all"
    else:
        decode, codec, counts = split_streams(int(name))
        out.setdefault("sms", {})[name] = {"decode": counts[0], "codec": counts[1], "device": counts[2]}
        t0 = time.perf_counter()
        batcher.decode_stream, worker._cuda = decode, codec
        capture_on(decode, recapture_decode)
        capture_on(codec, lambda: recapture_codec(worker, retired))
        out.setdefault("recapture_s", {})[name] = round(time.perf_counter() - t0, 1)
    ms = [decode_step_ms(decode) for _ in range(3)]
    out.setdefault("decode_step_ms_alone", {})[name] = round(statistics.median(ms), 3)
    print(json.dumps({"setting": name, "sms": out["sms"][name], "decode_step_ms_alone": out["decode_step_ms_alone"][name]}),
          flush=True)
    save()


settings = {name: (lambda name=name: apply(name)) for name in names}
out["levels"] = settings_in_turns(batcher, settings, streams, 1, "setting")
save()
for lv in out["levels"]:
    print(lv["setting"], lv["streams"], round(lv["aggregate_frames_per_s"]), "first audio p95",
          round(lv["first_audio_ms_p95"]), "decode", round(lv["per_request_decode_frames_per_s_median"]), flush=True)
