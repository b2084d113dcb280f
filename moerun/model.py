"""The model `moerun.load` returns: a `Decoder` (ids -> logits over a KV cache, moerun.decoder.model)
with generation driving it (moerun.generate). The decoder knows nothing of generation; generation,
batching and serving call the decoder, never the other way."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

from moerun.batching import Token
from moerun.decoder.model import Decoder
from moerun.generate import Generator


class MoEModel(Decoder):
    """A loaded model: `logits(ids)`, `generate(prompt, ...)`, `stats()`, `close()`, and the
    decoder's attributes (`config`, `tokenizer`, `dtype`, `device`, `run`, ...)."""

    @functools.cached_property
    def generator(self) -> Generator:
        """Drives this model's generations and holds the figures of the last one."""
        return Generator(self)

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int | None = 128, **options
    ) -> Iterator[Token]:
        """Yield up to `max_new_tokens` new tokens (None: until the context ends) after `prompt`;
        options: sampling, stop strings, logprobs, ctx_size (see moerun.generate.Generator)."""
        return self.generator.generate(prompt, max_new_tokens, **options)

    def stats(self) -> dict:
        """Figures of the last generation (moerun.generate.Generator.stats); with expert parallelism
        also this rank's figures under "expert_parallel" (Decoder.parallel_stats)."""
        run = self.generator.stats()
        if (parallel := self.parallel_stats()) is not None:
            run["expert_parallel"] = parallel
        return run
