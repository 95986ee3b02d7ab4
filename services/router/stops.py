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
        text held back that may begin a stop string released once it ends). A delta of several tokens ends
        at a token where its worker says where each token's text ends (`text_ends`), else as a whole (a
        repetition inside it then keeping its text)."""
        n = len(delta.token_ids)
        start = delta.completion_tokens - n
        steps = zip(range(1, n + 1), delta.text_ends) if delta.text_ends else [(n, len(delta.text))]
        text, checked, text_from = "", 0, 0
        for tokens_to, text_to in steps:
            repeated = None
            while self.repetition is not None and checked < tokens_to and repeated is None:
                checked += 1
                self.token_ids.append(delta.token_ids[checked - 1])
                decided = checked == n and delta.finish_reason is not None  # (the engine's own end checked first)
                if not decided and start + checked >= self.min_tokens and self.repetition.ends(self.token_ids):
                    repeated = checked
            released, stop = self.stops.feed(delta.text[text_from:text_to])
            text, text_from = text + released, text_to
            if stop is not None or repeated is not None:
                return self._ended(delta, text, repeated or tokens_to, stop)
        if delta.finish_reason is not None:
            text += self.stops.flush()
        return delta.model_copy(update={"text": text}) if text != delta.text else delta

    def _ended(self, delta: TokenDelta, text: str, kept: int, stop: str | None) -> TokenDelta:
        """`delta` ending the output at its `kept`th token, at the stop string `stop` (else a repetition)."""
        return delta.model_copy(
            update={
                "text": text if stop is not None else text + self.stops.flush(),
                "token_ids": delta.token_ids[:kept],
                "logprobs": delta.logprobs[:kept] if delta.logprobs is not None else None,
                "completion_tokens": delta.completion_tokens - len(delta.token_ids) + kept,
                "finish_reason": "repetition" if stop is None else "stop",
                "stop_reason": REPEATED if stop is None else stop,
                "text_ends": None,
            }
        )
