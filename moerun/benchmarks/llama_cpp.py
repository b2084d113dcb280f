"""llama.cpp as moerun's CPU peer: the same GGUF file run by llama-cpp-python in this process.

It is fed token ids through its low-level eval API (no sampling, no tokenizer), so the benchmark
times exactly what it times for moerun: the prefill of a prompt into an empty cache, and one decode
step per token; after each, the last position's logits are read. llama-cpp-python is optional (it
compiles llama.cpp for minutes when installed), so moerun never imports it outside this module.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

INSTALL = "pip install llama-cpp-python"  # builds llama.cpp from source: minutes, not seconds
NAME = "llama.cpp"


class PeerError(ValueError):
    """A peer that cannot run here, said in one sentence."""


def check_peer(path: str | Path | None) -> None:
    """Refuse, in one sentence, a run llama.cpp cannot be the peer of: no checkpoint, a checkpoint
    that is not a GGUF file, or llama-cpp-python not installed."""
    if path is None:
        raise PeerError("--peer llama.cpp runs on a checkpoint file: give --model FILE.gguf.")
    if Path(path).suffix != ".gguf" or not Path(path).is_file():
        raise PeerError(f"--peer llama.cpp runs only on a GGUF file, and {path} is not one.")
    import_llama_cpp()


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise PeerError(
            f"--peer llama.cpp needs llama-cpp-python, which is not installed: `{INSTALL}` (into the "
            "environment moerun runs in) builds it, in about 10 minutes."
        ) from None
    return llama_cpp


@contextlib.contextmanager
def _no_repack(llama_cpp):
    """llama_cpp.Llama built inside this loads as llama.cpp's `--no-repack` does: no extra buffer types,
    so the weights stay in the file's map instead of a repacked copy in anonymous memory."""
    low = llama_cpp.llama_cpp  # llama_cpp.Llama reads its default model parameters from here
    if "use_extra_bufts" not in dict(low.llama_model_params._fields_):
        raise PeerError(
            f"llama-cpp-python {llama_cpp.__version__} cannot turn llama.cpp's weight repacking off "
            "(its model parameters have no use_extra_bufts): install a newer one."
        )
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCppPeer:
    """A GGUF file in llama.cpp: `prefill(ids)` and `step(token)` return the last position's
    logits, fp32 [vocab]. `repack=False`: as `--no-repack` (weights used from the file's map)."""

    name = NAME

    def __init__(self, path: str | Path, n_ctx: int, threads: int | None = None, repack: bool = True):
        llama_cpp = import_llama_cpp()
        threads = threads or torch.get_num_threads()
        self.version = f"{NAME} (llama-cpp-python {llama_cpp.__version__})"
        with contextlib.nullcontext() if repack else _no_repack(llama_cpp):
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=512,
                logits_all=False,
                verbose=False,
            )
        self._logits = llama_cpp.llama_get_logits_ith
        self._vocab = self.llm.n_vocab()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()  # the next eval drops the cache from position 0 on
        self.llm.eval(ids)
        return self._last_logits()

    def step(self, token: int) -> torch.Tensor:
        self.llm.eval([token])
        return self._last_logits()

    def _last_logits(self) -> torch.Tensor:
        # with logits_all=False eval keeps no scores: llama.cpp's own buffer holds the last position's
        row = np.ctypeslib.as_array(self._logits(self.llm.ctx, -1), shape=(self._vocab,))
        return torch.from_numpy(row.copy())

    def close(self) -> None:
        self.llm.close()
