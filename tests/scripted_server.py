"""A server whose model writes a scripted reply: the tests of reply parsing through `moerun serve`
(tool calls, reasoning) drive a real server and client with a random model whose logits are set to
pick the reply's ids, so what comes back is known text."""

import torch

import moerun
from moerun.serve.server import start


def scripted_server(checkpoint, model_name: str):
    """A running server (one sequence at a time) on `checkpoint`'s model, whose k-th logits call
    picks the k-th id of the reply set by `server.play(text)` (the last id once the reply is out)."""
    model = moerun.load(checkpoint, dtype=torch.float32)
    vocab = model.config.vocab_size
    script = {"ids": [], "n": 0}

    def scripted_logits(hidden):
        logits = torch.full((vocab,), -1e4)
        logits[script["ids"][min(script["n"], len(script["ids"]) - 1)]] = 0.0
        script["n"] += 1
        return logits

    def play(reply: str) -> None:
        script.update(ids=model.tokenizer.encode(reply, add_special_tokens=False), n=0)

    model.hidden_logits = scripted_logits
    running = start(model, model_name=model_name, parallel=1)
    running.play = play
    return running
