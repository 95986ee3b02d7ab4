"""Where an output ends, across the prefill/decode boundary (and a migration's).

Each engine cuts its own output at a stop string, but one that starts in the prefill's first
token and ends in decode's output is seen by neither. The router therefore runs the text
through `StopFilter`, which holds back the last len(stop)-1 characters (as vLLM's detokenizer
does) so it never emits text that turns out to begin a stop string. Likewise a repetition
(vLLM's `repetition_detection`) that began before an engine took the request over is not in that
engine's output: `OutputEnd` checks the whole output's tokens.
"""

from __future__ import annotations

from llmesh.wire.messages import SamplingOptions, TokenDelta

REPEATED = "repetition_detected"  # vLLM's stop_reason of an output ended by repetition (finish_reason "repetition")


class StopFilter:
    def __init__(self, stops: list[str], include: bool = False):
        """`include`: the stop string stays at the end of the output (vLLM's include_stop_str_in_output),
        and text is released at once, as vLLM releases it then."""
        self._stops = [s for s in stops if s]
        self._include = include
        self._lookback = max((len(s) for s in self._stops), default=1) - 1  # a stop may begin this far back
        self._hold = 0 if include else self._lookback
        self._text = ""  # everything received
        self._emitted = 0  # characters of it already released

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Text safe to release now, and the stop string reached, if one was (then nothing follows): as
        vLLM's detokenizer picks it, the one that ends earliest in the text, of two ending together the
        first listed."""
        if not self._stops:
            return delta, None
        self._text += delta
        search_from = max(self._emitted - self._lookback, 0)
        hits = [(i, stop) for stop in self._stops if (i := self._text.find(stop, search_from)) != -1]
        if hits:
            start, stop = min(hits, key=lambda hit: hit[0] + len(hit[1]))
            end = start + len(stop) if self._include else start
            out, self._emitted = self._text[self._emitted : end], max(end, self._emitted)
            return out, stop
        safe = max(len(self._text) - self._hold, self._emitted)
        out, self._emitted = self._text[self._emitted : safe], safe
        return out, None

    def flush(self) -> str:
        """The held-back tail, once the output ended for another reason."""
        if not self._stops:
            return ""
        out, self._emitted = self._text[self._emitted :], len(self._text)
        return out


class OutputEnd:
    """One request's output, checked for its ends across engines as vLLM's engine and detokenizer check one
    output: a token that completes a repetition ends it (after `min_tokens`, unless the engine ended it there
    for another reason), and a stop string in its text ends it, the stop string winning."""

    def __init__(self, sampling: SamplingOptions):
        self.stops = StopFilter(sampling.stop, sampling.include_stop_str_in_output)
        self.repetition, self.min_tokens = sampling.repetition_detection, sampling.min_tokens
        self.token_ids: list[int] = []  # the whole output's so far (where repetition is checked)

    def shown(self, delta: TokenDelta) -> TokenDelta:
        """`delta` as the client gets it: ended at a repetition or a stop string where one is reached (the
        text held back that may begin a stop string released once it ends)."""
        update: dict = {}
        if self.repetition is not None and delta.finish_reason is None:
            start = delta.completion_tokens - len(delta.token_ids)
            for i, token in enumerate(delta.token_ids):
                self.token_ids.append(token)
                if start + i + 1 >= self.min_tokens and self.repetition.ends(self.token_ids):
                    # (an engine step makes one token a request: the text of a delta cut inside would be kept)
                    kept = delta.token_ids[: i + 1]
                    update = {
                        "token_ids": kept,
                        "logprobs": delta.logprobs[: i + 1] if delta.logprobs is not None else None,
                        "completion_tokens": start + len(kept),
                        "finish_reason": "repetition",
                        "stop_reason": REPEATED,
                    }
                    break
        text, stop = self.stops.feed(delta.text)
        if stop is not None:
            update |= {"finish_reason": "stop", "stop_reason": stop}
        elif delta.finish_reason is not None or update:
            text += self.stops.flush()
        if text != delta.text:
            update["text"] = text
        return delta.model_copy(update=update) if update else delta
