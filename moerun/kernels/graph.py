"""CUDA graphs for the decode step: the device work of one step captured once, replayed per token.

A `GraphedStep` owns fixed input buffers. `run(**inputs)` copies the step's inputs into them (the
host stage: a handful of small copies) and replays the graph, whose kernels read only those buffers
and tensors that never move (weights, cache slots). The first call runs eagerly, so Triton compiles
its kernels outside the capture; the second captures; every later call replays. Off CUDA (triton's
interpreter) every call runs eagerly, so the same code path is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class GraphedStep:
    def __init__(self, fn: Callable[..., torch.Tensor], buffers: Mapping[str, torch.Tensor]):
        """`fn(**buffers)` -> an output tensor; `buffers` are the fixed inputs it reads."""
        self.fn = fn
        self.buffers = dict(buffers)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.calls = 0
        self.cuda = all(b.device.type == "cuda" for b in self.buffers.values())

    def run(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Copy `inputs` into the buffers of the same names and run the step; the result is a view of
        a fixed output buffer, valid until the next run."""
        for name, value in inputs.items():
            self.buffers[name].copy_(value, non_blocking=True)
        self.calls += 1
        if not self.cuda or self.calls == 1:
            return self.fn(**self.buffers)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.output

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs advises
            self.fn(**self.buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.output = self.fn(**self.buffers)
        self.graph = graph
