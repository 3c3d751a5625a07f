"""One torch step graph on an accelerator (CUDA, XPU): its caches, inputs and outputs kept on the
device, and on CUDA its steps replayed as CUDA graphs.

Per step, the token ids, positions, logit rows and cache position cross to the device in one copy
from pinned memory, and the attention bias in a second; hidden states stay on the device (the engine
feeds them back to the draft as device tensors), logits stay there behind DeviceRows (the decoding
loop reads their argmax, or the few rows that prefill and sampling need), and only the draft's top-k
comes back. Compaction moves cache rows on the device.

CUDA graphs: a step launches several kernels per layer, and launching them one by one can take
longer on the host than a small model's step takes on a large GPU, so each step shape is captured
once, on first use, and replayed. Step sizes are padded to powers of two (a tree of 5 tokens runs
as 8 rows), which bounds the graphs to 8 per number of logit rows. A padding row is token 0 at position 0 that sees only its
own key: its output is finite and unused, and it writes K/V just past the step's rows, at positions
every real row masks and that no step reads before writing them itself.
"""
from __future__ import annotations

import warnings

import numpy as np

from artifact.graphs import GraphSpec

WARMUP = 2  # eager runs before a capture (cuBLAS sets up its workspace on the capture stream)


def bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


class DeviceRows:
    """Logits [.., V] left on the device. Slicing rows keeps them there; argmax brings back ids only;
    indexing one row (prefill's last row, a row the sampling walk visits) brings back that row."""

    def __init__(self, tensor):
        self.tensor = tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.tensor.shape)

    def __len__(self) -> int:
        return len(self.tensor)

    def __getitem__(self, key):
        rows = self.tensor[key]
        return DeviceRows(rows) if rows.dim() > 1 else rows.cpu().numpy()

    def argmax(self, axis=None):
        # torch, like numpy, returns the first of equal maxima.
        return self.tensor.argmax(dim=axis).cpu().numpy()

    def __array__(self, dtype=None, copy=None):
        a = self.tensor.cpu().numpy()
        return a if dtype is None else a.astype(dtype)


class DeviceSteps:
    """The step graph's device buffers: caches, inputs padded to a bucket, and its CUDA graphs."""

    def __init__(self, torch, module, io: GraphSpec, device: str, cache_length: int, max_tokens: int,
                 cuda_graphs: bool):
        self.torch, self.module, self.device = torch, module, device
        self.length, self.max_tokens = cache_length, max_tokens
        self.input_names, self.output_names = io.inputs, io.outputs
        kind = torch.device(device).type
        self.synchronize = getattr(torch, kind).synchronize
        # Caches of one shape share a store, so that compaction moves every layer's rows at once.
        dims = io.cache_dims
        self.stores = {d: torch.zeros(dims.count(d), d[0], cache_length, d[1], device=device)
                       for d in dict.fromkeys(dims)}
        taken = dict.fromkeys(self.stores, 0)
        self.caches = []
        for d in dims:
            self.caches.append(self.stores[d][taken[d]:taken[d] + 1])
            taken[d] += 1
        m = max_tokens
        pin = kind == "cuda"
        # [ids | positions | logit rows | cache position], padded with zeros; then compaction's indices.
        self.host_ints = torch.zeros(3 * m + 1, dtype=torch.int64, pin_memory=pin)
        self.ints = torch.zeros(3 * m + 1, dtype=torch.int64, device=device)
        self.host_moves = torch.zeros(2 * m, dtype=torch.int64, pin_memory=pin)
        self.moves = torch.zeros(2 * m, dtype=torch.int64, device=device)
        self.bias = torch.zeros(m * cache_length, device=device)
        self.features = torch.zeros(m, io.shapes["features"][2], device=device) if "features" in io.shapes else None
        self.graphs = {} if cuda_graphs else None
        self.graph_error: str | None = None
        self._stream = self._pool = None  # made at the first capture

    def run(self, inputs: dict, t: int, k: int) -> dict:
        torch, m, length = self.torch, self.max_tokens, self.length
        r = len(inputs["logit_rows"])
        total = inputs["attention_bias"].shape[-1]
        # Padding must fit the buffers and the cache; a step that it would not fit runs eagerly.
        graphed = self.graphs is not None and bucket(t) <= m and total - t + bucket(t) <= length
        b, rb = (bucket(t), bucket(r)) if graphed else (t, r)
        ints = self.host_ints.numpy()
        ints[:] = 0
        ints[:t] = inputs["input_ids"][0]
        ints[m:m + t] = inputs["position_ids"][0]
        ints[2 * m:2 * m + r] = inputs["logit_rows"]
        ints[3 * m] = total - t
        self.ints.copy_(self.host_ints, non_blocking=True)  # the pinned buffer is free again once run() syncs
        bias = self.bias[:b * length].view(b, length)
        bias.fill_(torch.finfo(torch.float32).min)
        bias[:t, :total].copy_(torch.from_numpy(inputs["attention_bias"][0, 0]))
        torch.diagonal(bias[t:, total:total + b - t]).zero_()  # padding rows see their own key
        views = {"input_ids": self.ints[:b].view(1, b), "position_ids": self.ints[m:m + b].view(1, b),
                 "attention_bias": bias.view(1, 1, b, length), "logit_rows": self.ints[2 * m:2 * m + rb],
                 "cache_position": self.ints[3 * m:3 * m + 1]}
        if self.features is not None:
            self.features[:t].copy_(torch.as_tensor(inputs["features"][0]))
            views["features"] = self.features[:b].view(1, b, -1)
        args = [views[n] for n in self.input_names] + self.caches
        outs = self._replay((b, rb), args) if graphed else self._call(args)
        result = {}
        for name, value in zip(self.output_names, outs):
            if name == "hidden_states":
                result[name] = value[:, :t]
            elif name == "logits":
                result[name] = DeviceRows(value[:, :r])
            else:  # topk_*: the graph returns its MAX_K best
                result[name] = value[:, :r, :k].cpu().numpy()
        # Steps are timed by the caller (prefill / draft / verify); without this a verify step,
        # whose logits stay on the device, would return before its kernels ran.
        self.synchronize(self.device)
        return result

    def move(self, source: np.ndarray, destination: int) -> None:
        n = len(source)
        moves = self.host_moves.numpy()
        moves[:n] = source
        moves[n:2 * n] = np.arange(destination, destination + n)
        index = self.moves[:2 * n]
        index.copy_(self.host_moves[:2 * n])
        for store in self.stores.values():
            store.index_copy_(2, index[n:], store.index_select(2, index[:n]))

    def _call(self, args):
        torch = self.torch
        # optimized_execution(False): see TorchSession.run.
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            return self.module(*args)

    def _replay(self, key, args):
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(args)
            except RuntimeError as e:
                # A step that cannot be captured still runs, eagerly, as do all later ones.
                self.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                warnings.warn(f"CUDA graph capture failed, running eagerly: {self.graph_error}")
                self.graphs = None
                return self._call(args)
        graph, outs = self.graphs[key]
        graph.replay()
        return outs

    def _capture(self, args):
        """Capture the step on the inputs already in place. The warm-up runs write the step's cache
        rows with the values the replay then writes again. All graphs share one memory pool and one
        stream: their temporaries may overlap, which is safe because replays never overlap and the
        engine reads a session's outputs before its next run (as with ONNX Runtime's bound buffers)."""
        torch = self.torch
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for _ in range(WARMUP):
                    self._call(args)
            current.wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                outs = self._call(args)
        return graph, outs
