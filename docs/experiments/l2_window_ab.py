"""Whole engines in turns, the fast transformer's weights packed into one buffer and a first part
of it kept in a persisting slice of L2 (CUDA's access-policy window, set on every kernel node of
the captured frames), or not. A frame reads the fast layers' weights nine times (INT8: ~48 MiB,
bf16: ~96 MiB, against the H100's 50 MB of L2); the slow layers' ~440 M parameters stream past
between frames and, without a window, evict them. Not part of the package.

    python docs/experiments/l2_window_ab.py CHECKPOINT_DIR "int8:0;int8:max;bf16:0;bf16:max" [ROUNDS]
        VARIANT = weights:window[:noprefetch]: weights bf16 or int8; window, MiB of the packed fast
        weights (from the first layer's wqkv on) kept in L2 (0: none; max: as much as the device
        sets aside); noprefetch: the fast products do not stream the next product's weights.
        Decode speed in turns ($OUT/l2_window_ab.json), the compiled-against-eager check
"""
import ctypes, glob, json, os, sys

import torch

from fish_sm.engine import generate
from fish_sm.model import row_products

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from experiment_tools import compiled_variant, decode_in_turns  # noqa: E402

OUT = os.environ.get("OUT", ".")
MIB = 1 << 20
LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
ATTR_MAX_PERSISTING_L2, ATTR_MAX_WINDOW = 108, 109  # cudaDevAttrMaxPersistingL2CacheSize, ...MaxAccessPolicyWindowSize
NODE_KERNEL, LAUNCH_ATTR_WINDOW = 0, 1  # cudaGraphNodeTypeKernel, cudaLaunchAttributeAccessPolicyWindow
PERSISTING, STREAMING = 2, 1  # cudaAccessProperty


class Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class AttrValue(ctypes.Union):  # cudaLaunchAttributeValue: 64 bytes
    _fields_ = [("window", Window), ("pad", ctypes.c_char * 64)]


def cudart():
    try:
        return ctypes.CDLL("libcudart.so.13")  # torch's own, already loaded
    except OSError:
        for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so.*")):
            return ctypes.CDLL(path)
        raise


RT = cudart()


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: cudaError {code}")


def device_attr(attr: int) -> int:
    v = ctypes.c_int()
    check(RT.cudaDeviceGetAttribute(ctypes.byref(v), attr, torch.cuda.current_device()), "cudaDeviceGetAttribute")
    return v.value


def set_aside(nbytes: int) -> None:
    check(RT.cudaDeviceSetLimit(LIMIT_PERSISTING_L2, ctypes.c_size_t(nbytes)), "cudaDeviceSetLimit")
    check(RT.cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")
    torch.cuda.synchronize()


def pack_fast_weights(model) -> torch.Tensor:
    """The fast layers' projections and the fast head's weight (INT8's head stays bf16) as views
    of one buffer of bytes, in the order a pass reads them; returns the buffer."""
    linears = [getattr(getattr(b, part), name) for b in model.fast_layers
               for part, name in b.PRODUCTS.values()] + [model.fast_output]
    data = [row_products.product_weights(l)[0] for l in linears]
    buffer = torch.empty(sum(d.nbytes for d in data), dtype=torch.uint8, device=data[0].device)
    at = 0
    for linear, d in zip(linears, data):
        view = buffer[at:at + d.nbytes].view(d.dtype).view_as(d)
        view.copy_(d)
        if type(linear.weight) is torch.nn.Parameter:
            linear.weight.data = view
        else:
            linear.weight.qdata = view
        at += d.nbytes
    return buffer


def windowed_capture(window: dict):
    """`GraphedStep._capture` keeping the graph, setting `window` (base, bytes) as every kernel
    node's access-policy window (none if bytes is 0), then instantiating."""
    def _capture(self, run):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        if window["bytes"]:
            raw = ctypes.c_void_p(graph.raw_cuda_graph())
            n = ctypes.c_size_t(0)
            check(RT.cudaGraphGetNodes(raw, None, ctypes.byref(n)), "cudaGraphGetNodes")
            nodes = (ctypes.c_void_p * n.value)()
            check(RT.cudaGraphGetNodes(raw, nodes, ctypes.byref(n)), "cudaGraphGetNodes")
            value = AttrValue()
            value.window = Window(window["base"], window["bytes"], 1.0, PERSISTING, STREAMING)
            kernels = 0
            for node in nodes:
                kind = ctypes.c_int()
                check(RT.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
                if kind.value == NODE_KERNEL:
                    check(RT.cudaGraphKernelNodeSetAttribute(ctypes.c_void_p(node), LAUNCH_ATTR_WINDOW,
                                                             ctypes.byref(value)), "cudaGraphKernelNodeSetAttribute")
                    kernels += 1
            window["kernels"] = window.get("kernels", 0) + kernels
        graph.instantiate()
        return graph, out
    return _capture


def main(checkpoint: str, variants: list[str], rounds: int) -> dict:
    most = device_attr(ATTR_MAX_PERSISTING_L2)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size, "max_persisting_l2_bytes": most,
           "max_window_bytes": device_attr(ATTR_MAX_WINDOW), "variants": {}, "rounds": []}
    print(json.dumps(out), flush=True)
    save = lambda: json.dump(out, open(os.path.join(OUT, "l2_window_ab.json"), "w"), indent=1)
    shipped_capture = generate.GraphedStep._capture
    window = {}  # that of the engine being compiled: base, bytes, packed_bytes, kernels
    generate.GraphedStep._capture = windowed_capture(window)
    engines, set_asides = {}, {}
    for variant in variants:
        mode, size, *flags = variant.split(":")

        def prepare(engine):
            packed = engine._packed_fast = pack_fast_weights(engine.model)
            nbytes = min(packed.nbytes, most if size == "max" else int(float(size) * MIB), most) // MIB * MIB
            window.clear()
            window.update(base=packed.data_ptr(), bytes=nbytes, packed_bytes=packed.nbytes)
            set_aside(nbytes)
            if "noprefetch" in flags:
                chain = engine.model._chain_row_weights

                def no_fast_prefetch(ahead, model=engine.model):
                    chain(ahead)
                    for block in model.fast_layers:
                        block.rows_ahead = {}
                    model.rows_ahead.pop("fast_head", None)
                    model.rows_ahead.pop("head", None)
                engine.model._chain_row_weights = no_fast_prefetch

        engines[variant] = compiled_variant(checkpoint, mode, variant, out, save, prepare,
                                            facts=lambda engine: {"window": dict(window)})
        set_asides[variant] = window["bytes"]
    generate.GraphedStep._capture = shipped_capture
    decode_in_turns(engines, rounds, out, save, before=lambda name: set_aside(set_asides[name]))
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]) if len(sys.argv) > 3 else 3)
